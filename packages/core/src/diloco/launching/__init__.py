"""From a spec to a supervised run: the launcher, the rendezvous check, one executor over several groups."""
