"""The remote tier: processed items shared between hosts through an existing store.

* :class:`RemoteStore` - ``contains`` / ``get`` / ``put`` (put-if-absent) of items under
  content-hash keys in a namespace, over Redis/Valkey (``redis://``, ``valkey://``) or
  Mooncake Store (``mooncake://``).  Values are self-describing envelopes verified end to end
  (:mod:`.envelope`); every failure is a counted miss, every call has a deadline, a circuit
  breaker stops calling a failing store.
* :class:`TieredSenderCache` - P0's cache with the remote tier behind it: a local miss asks
  the remote tier before processing, a processed item is published by a writer thread.
* :mod:`.local_server` - a real server started on a free loopback port, for ``mmcache
  simulate --remote redis://auto``, benchmarks and tests.

Needs the ``remote`` extra (``pip install 'mmcache[remote]'``), and ``mooncake`` for
``mooncake://``.
"""

from mmcache.remote.store import CircuitBreaker, RemoteStore, is_shareable_key
from mmcache.remote.tiered import TieredSenderCache

__all__ = ["CircuitBreaker", "RemoteStore", "TieredSenderCache", "is_shareable_key"]
