"""The offline (SFT, DPO, KTO) quickstart's assets: `python -m rlhf_megatron.offline.quickstart`.

The offline algorithms themselves run in the one step loop (controller/loop.py) with the offline
source (controller/offline_source.py), the datasets of data/offline_datasets.py and the losses of
algorithms/preference.py (engines/offline_update.py)."""
