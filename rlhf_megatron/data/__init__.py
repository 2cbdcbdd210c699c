"""Batches, packing and micro-batching (datasets and chat templates arrive with the controller)."""
