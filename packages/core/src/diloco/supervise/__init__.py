"""The supervisor and its parts: the lease, the restart policy, reactions to a rank, resizing."""
