"""The exchange beside the training loop: the exchanger, the sync process and its wire, shared buffers."""
