"""A stand-in trainer for the weight-update tests: joins a weight update group as rank 0 the way the RL frameworks'
trainers do (a TCP store it hosts, PrefixStore(group_name), a new gloo process group), then broadcasts a checkpoint's
tensors in the order of its --names file, one broadcast per tensor or one flattened uint8 bucket; after each round
it waits for a line on stdin (the engine has answered), then exits.

    python tests/rl_trainer.py --port P --world-size N --group G --checkpoint DIR --names names.json [--flattened]

Independent of redraft: it reads the checkpoint with safetensors and talks torch.distributed only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world


def join(port: int, world_size: int, group_name: str, backend: str = "gloo") -> object:
    timeout = datetime.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=True, timeout=timeout)
    group = _new_process_group_helper(world_size, 0, [], backend, PrefixStore(group_name, store),
                                      group_name=group_name, timeout=timeout)
    group = group[0] if isinstance(group, tuple) else group
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--group", required=True)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--names", required=True, help="a JSON list of the tensor names to send, in order")
    p.add_argument("--flattened", action="store_true")
    p.add_argument("--rounds", type=int, default=1, help="send the list this many times (one update each)")
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    p.add_argument("--device", default="cpu", help="where the sent tensors live (cuda:N for nccl)")
    p.add_argument("--delay", type=float, default=0.0, help="seconds to wait before joining (a slow trainer)")
    a = p.parse_args()
    time.sleep(a.delay)
    if a.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(a.device))
    tensors = {n: t.to(a.device) for n, t in load_file(f"{a.checkpoint}/model.safetensors").items()}
    names = json.loads(open(a.names).read())
    group = join(a.port, a.world_size, a.group, a.backend)
    print("joined", flush=True)
    for _ in range(a.rounds):
        if a.flattened:
            flat = torch.cat([tensors[n].contiguous().view(-1).view(torch.uint8) for n in names])
            dist.broadcast(flat, src=0, group=group)
        else:
            for n in names:
                dist.broadcast(tensors[n].contiguous(), src=0, group=group)
        print("sent", flush=True)
        sys.stdin.readline()  # the test says when the engine has answered (the store we host must outlive it)
    dist.destroy_process_group(group)
    return 0


if __name__ == "__main__":
    sys.exit(main())
