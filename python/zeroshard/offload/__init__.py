"""Offload: where the optimizer's state shards live, and how offloaded ranges step.

A policy the shard sources and the update rule consult, never a branch inside
them ([Note: offload] in ``offload/policy.py``):

* ``policy``    the checked arguments (``Offload``, ``Placement``) and which whole
                parameters or units are offloaded;
* ``storage``   allocating shards on the device, in host memory or in the rank's
                file, and what a placement implies ([Note: offload params]);
* ``disk``      the rank's state file (``offload="nvme"``);
* ``io_engine`` its reads and writes by direct I/O, several in flight (the C++
                core's I/O engine, [Note: I/O engine] in csrc/io_engine.h);
* ``copies``    gradients copied to host memory as backward reduces them
                ([Note: offloaded gradients]);
* ``streamer``  the windowed, double-buffered CPU step over streamed ranges.

May import: ``native`` (the CPU AdamW kernel, the I/O engine). The other parts use it through
the names below.
"""

from .copies import HostCopies
from .policy import NO_OFFLOAD, Offload, Placement, check_directory, choose, offloaded_params, parse_offload
from .storage import Storage, host_empty, host_zeros, on_accelerator, planning_for_host
from .streamer import Streamer, window_elements

__all__ = [
    "HostCopies",
    "NO_OFFLOAD",
    "Offload",
    "Placement",
    "check_directory",
    "choose",
    "offloaded_params",
    "parse_offload",
    "Storage",
    "host_empty",
    "host_zeros",
    "on_accelerator",
    "planning_for_host",
    "Streamer",
    "window_elements",
]
