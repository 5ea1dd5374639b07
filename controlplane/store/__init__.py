"""The only code that talks to etcd."""

from controlplane.store.etcd import Entry, Lease, Store

__all__ = ["Entry", "Lease", "Store"]
