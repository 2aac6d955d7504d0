"""The run's object store: opening it, its key layout, waiting out outages, and what replicas and the
launcher keep in it (presence, scale requests, round metrics, the byte sizes of what replicas put)."""
