"""The Ray plumbing of a run: the cluster and its device pools (``ray_cluster``), groups of Ray
actors called together (``worker_group``), the typed facades over them (``facades``), building
every group of a run (``groups``), and the processes a run must leave behind it (``lifecycle``)."""
