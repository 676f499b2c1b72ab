"""The shm transport: collectives among the ranks of one host through shared memory.

- :mod:`.protocol`: the segment layout and its counters (what every member reads);
- :mod:`.communicator`: :class:`ShmCommunicator`, the segment owner: the counters'
  ``publish``/``wait_for``/``begin`` seam, the segment paths of every collective, and
  the single-copy agreement;
- :mod:`.single_copy`: every collective that reads or writes peers' memory directly
  (cross-memory attach, through :mod:`ronde.transport.vm`).
"""

from .communicator import ShmCommunicator
from .protocol import CMA_MIN_BYTES, SMALL_BYTES, TABLE_ENTRIES

__all__ = ["ShmCommunicator", "CMA_MIN_BYTES", "SMALL_BYTES", "TABLE_ENTRIES"]
