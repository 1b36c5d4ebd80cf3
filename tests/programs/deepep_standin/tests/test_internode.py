"""A stand-in for DeepEP's tests/test_internode.py on machines without GPUs, for the tests of a4ray's
DeepEP launch: the same launch contract (one process per node; WORLD_SIZE = nodes, RANK = node rank,
MASTER_ADDR/MASTER_PORT; it spawns --num-processes workers that rendezvous as rank RANK*n + local), the
same asserts on experts and ranks, and the same output format from local rank 0 of every node, with a
real gloo all_reduce and all_to_all in place of DeepEP's kernels. It also fails unless DeepEP's env
(from the env script and the spec) reached it."""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def loop(local_rank: int, num_local_ranks: int, args: argparse.Namespace) -> None:
    num_nodes, node_rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    num_ranks, rank = num_nodes * num_local_ranks, node_rank * num_local_ranks + local_rank
    dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                            world_size=num_ranks, rank=rank)
    assert args.num_experts % num_ranks == 0 and num_ranks > num_local_ranks
    if local_rank == 0:
        print(f"[config] num_tokens={args.num_tokens}, hidden={args.hidden}, num_topk_groups={min(num_nodes, 4)}, "
              f"num_topk={args.num_topk}", flush=True)
        print("[layout] Kernel performance: 0.101 ms", flush=True)
    for previous in (False, True):
        for async_mode in (False, True):
            for x in ("BF16", "FP8"):
                if local_rank == 0:
                    print(f"[testing] Running with {x}, with top-k (async={async_mode}, previous={previous}) ...",
                          flush=True, end="")
                probe = torch.full((4,), float(rank))
                dist.all_reduce(probe)
                assert probe[0] == num_ranks * (num_ranks - 1) / 2
                if local_rank == 0:
                    print(" passed", flush=True)
    tokens = torch.ones(num_ranks * 4096)
    out = torch.empty_like(tokens)
    t0 = time.perf_counter()
    dist.all_to_all_single(out, tokens)
    gbps = tokens.numel() * 4 / 1e9 / (time.perf_counter() - t0)
    if local_rank == 0:
        for name in ("dispatch (FP8)", "dispatch (BF16)"):
            print(f"[tuning] Best {name}: SMs 24, NVL chunk 8, RDMA chunk 16: 1.0 + 2.0 us, {gbps:.2f} GB/s (RDMA), "
                  f"{2 * gbps:.2f} GB/s (NVL)", flush=True)
        print(f"[tuning] Best combine: SMs 24, NVL chunk 4, RDMA chunk 16, 1.0 + 2.0 us, {gbps:.2f} GB/s (RDMA), "
              f"{2 * gbps:.2f} GB/s (NVL)", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--num-processes", type=int, default=8)
    p.add_argument("--num-tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--num-topk", type=int, default=8)
    p.add_argument("--num-experts", type=int, default=256)
    p.add_argument("--num-topk-groups", type=int)
    args = p.parse_args()
    missing = [v for v in ("NVSHMEM_REMOTE_TRANSPORT", "DEEP_EP_DEVICE_TO_HCA_MAPPING") if not os.environ.get(v)]
    if missing:
        raise SystemExit(f"DeepEP env missing: {missing}")
    mp.spawn(loop, args=(args.num_processes, args), nprocs=args.num_processes)
