"""Process groups: start a local group of workers, or join one made by `torchrun`.

One process per worker. With CUDA, NCCL and one GPU per worker (``cuda:local_rank``);
without it, gloo on CPU. Local groups rendezvous over TCP on a free loopback port, so
several groups (for instance test modules run side by side) never collide.

Every listener of a local group is on loopback (the group is unauthenticated): rank 0's
TCPStore serves a socket this module binds to 127.0.0.1 (torch's own binds every
interface whatever host it is given), and gloo's and NCCL's connections between workers
use the loopback interface (`GLOO_SOCKET_IFNAME` / `NCCL_SOCKET_IFNAME`, unless set). A
group made by `torchrun` spans machines: it keeps the addresses torchrun was given.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """A dtype name ("float32", "bf16", ...) or a torch.dtype -> torch.dtype (None: float32)."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} or a torch.dtype; got {dtype!r}")
    return DTYPES[dtype]


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


@dataclass
class ParallelGroup:
    """The view one worker has of its group: who it is, who its peers are, where it computes."""

    rank: int
    world_size: int
    device: torch.device
    group: dist.ProcessGroup | None = None  # None means the default (world) group

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def global_rank(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def subgroup(self, ranks: list[int], group: dist.ProcessGroup) -> "ParallelGroup":
        """This worker's view of a sub-group it belongs to (ranks are global ranks)."""
        me = dist.get_rank()
        return ParallelGroup(rank=ranks.index(me), world_size=len(ranks), device=self.device, group=group)


def init_local_group(
    rank: int,
    world_size: int,
    port: int,
    device: str | None = None,
    timeout_s: float = 600.0,
) -> ParallelGroup:
    """Join a group of `world_size` local processes that rendezvous on 127.0.0.1:`port`."""
    device = device or default_device()
    if device.startswith("cuda"):
        torch.cuda.set_device(rank % torch.cuda.device_count())
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        dev = torch.device("cpu")
    if not dist.is_initialized():
        kwargs = {}
        if dev.type == "cuda":
            kwargs["device_id"] = dev
        timeout = datetime.timedelta(seconds=timeout_s)
        lo = loopback_interface()
        if lo is not None:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)    # else gloo listens on the hostname's address
            os.environ.setdefault("NCCL_SOCKET_IFNAME", lo)    # else NCCL's bootstrap picks a network interface
        dist.init_process_group(
            backend=backend_for(device),
            store=loopback_store(rank, world_size, port, timeout),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            **kwargs,
        )
    return ParallelGroup(rank=rank, world_size=world_size, device=dev)


def loopback_store(rank: int, world_size: int, port: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """The group's rendezvous store on 127.0.0.1:`port`, served by rank 0 on a socket bound to loopback only
    (handed to the store, which owns it from then on)."""
    listen_fd = None
    if rank == 0:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))
            sock.listen(max(128, world_size))
        except OSError:
            sock.close()
            raise
        listen_fd = sock.detach()
    return dist.TCPStore("127.0.0.1", port, world_size, rank == 0, timeout=timeout, master_listen_fd=listen_fd)


def loopback_interface() -> str | None:
    """The name of the loopback network interface ("lo" on Linux, "lo0" on macOS), None if none is found."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((n for n in ("lo", "lo0") if n in names), None)


def init_from_torchrun(device: str | None = None) -> ParallelGroup:
    """Join the group described by torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*)."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"not launched by torchrun: environment variables {missing} are not set")
    device = device or default_device()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device.startswith("cuda"):
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if not dist.is_initialized():
        # a rank that fails exits (see engine.pool.TorchrunPool); its peers' collectives give up after this long
        timeout = datetime.timedelta(seconds=float(os.environ.get("LONGSERVE_COLLECTIVE_TIMEOUT_S", 600)))
        dist.init_process_group(backend=backend_for(device), init_method="env://", timeout=timeout)
    return ParallelGroup(rank=dist.get_rank(), world_size=dist.get_world_size(), device=dev)


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
