"""Store-level bench of the disk tier (``TieredTable.on_disk``) on this machine's real disk:
does lookahead hide NVMe-class reads? One table larger than its host cache, Zipf ids, a
device step emulated by a sleep of ``--step-ms`` (the GPU's compute while the host waits:
labelled so), and the same batches at several depths, in interleaved rounds:

* ``reactive`` - depth 0: every batch's disk reads and fills on the critical path;
* ``depth_1`` - one batch ahead (FBGEMM's SSD TBE and TorchRec's prefetch pipeline);
* ``depth_K`` - K batches ahead;
* ``dram`` - the same table held in DRAM at the deepest depth (the upper bound).

Final parameters are compared bit for bit across every configuration. Not the TorchRec
path yet (the sharder does not serve ``key_value`` tables); ``bench --tier ssd`` will be.

Run: ``python benchmarks/disk_tier_bench.py [--rows 2000000] [--json F]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from typing import Dict, List

import torch

from torchrec_proactive.fetch import FetchEngine
from torchrec_proactive.fetch.lookahead import run_lookahead
from torchrec_proactive.store import OptimizerConfig, OptimType, TieredTable, pooled_lookup


def _batches(rows: int, n: int, ids: int, dim: int, seed: int, alpha: float = 1.05):
    g = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, rows + 1, dtype=torch.float64)
    probs = ranks ** -alpha
    perm = torch.randperm(rows, generator=g)  # hot rows spread over the file, as hashed ids are
    out = []
    for _ in range(n):
        v = perm[torch.multinomial(probs, ids, replacement=True, generator=g)]
        out.append((v, torch.arange(ids + 1), None, torch.randn(ids, dim, generator=g)))
    return out


def _run(table: TieredTable, batches, depth: int, step_s: float) -> float:
    engine = FetchEngine()
    anchor = torch.empty(0, requires_grad=True)
    times: List[float] = []

    def consume(i, tb, batch):
        pooled_lookup(tb, anchor).backward(batch[3])
        time.sleep(step_s)  # the device's compute, emulated
        times.append(time.perf_counter())

    t0 = time.perf_counter()
    run_lookahead(table, engine, batches, depth, consume)
    engine.drain()
    warm = len(times) // 5
    return (len(times) - warm) * batches[0][0].numel() / (times[-1] - (times[warm - 1] if warm else t0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--ids", type=int, default=2048, help="ids per batch")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--step-ms", type=float, default=10.0)
    ap.add_argument("--host-cache-frac", type=float, default=0.25)
    ap.add_argument("--device-cache-frac", type=float, default=0.05)
    ap.add_argument("--depths", default="1,2,4,8")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    depths = [int(d) for d in a.depths.split(",")]
    config = OptimizerConfig(OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.05)
    torch.manual_seed(0)
    init = torch.randn(a.rows, a.dim) * 0.01
    slots = int(a.device_cache_frac * a.rows)
    record = a.dim * 4 + 8  # (the record is padded to 8 bytes)
    host_bytes = int(a.host_cache_frac * a.rows * record)
    configs = [("reactive", 0, "disk")] + [(f"depth_{d}", d, "disk") for d in depths] + [("dram", max(depths), "dram")]
    rates: Dict[str, List[float]] = {name: [] for name, _, _ in configs}
    finals: Dict[str, torch.Tensor] = {}
    info: Dict[str, object] = {}
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        for r in range(a.rounds):
            batches = _batches(a.rows, a.steps, a.ids, a.dim, seed=r)
            for name, depth, tier in configs:
                if tier == "dram":
                    table = TieredTable("t", init.clone(), config, num_slots=slots)
                else:
                    table = TieredTable.on_disk("t", a.rows, a.dim, config, num_slots=slots, directory=d,
                                                host_cache_bytes=host_bytes, initial_weight=init, io_threads=32)
                try:
                    s0 = table.disk.stats() if tier == "disk" else {}  # (after writing the initial rows)
                    rate = _run(table, batches, depth, a.step_ms / 1e3)
                    rates[name].append(rate)
                    if tier == "disk":
                        s = {k: v - s0.get(k, 0) for k, v in table.disk.stats().items()}
                        info.setdefault(name, {}).update(  # type: ignore[union-attr]
                            o_direct=table.disk.file.o_direct, disk_rows_per_step=s["rows_read"] / a.steps,
                            disk_pages_per_step=s["pages_read"] / a.steps,
                            max_requests_in_flight=s["max_requests_in_flight"],
                            table_bytes=table.disk.file.size, host_cache_bytes=table.disk.num_slots * table.disk.record)
                    if r == a.rounds - 1:
                        engine = FetchEngine()
                        engine.flush([table])
                        if tier == "disk":
                            table.flush_to_disk()
                            t = table.disk.prefetch(torch.arange(0, 1000).numpy())
                            table.disk.wait(t)
                            finals[name] = table.gather_host(torch.arange(0, 1000))[0].clone()
                            table.disk.release(t)
                        else:
                            finals[name] = table.host_weight[:1000].clone()
                finally:
                    table.close()
                print(f"round {r} {name:10s} {rate:9.0f} ids/s", flush=True)
    ref = finals["dram"]
    out = {"step_ms_emulated": a.step_ms, "rows": a.rows, "dim": a.dim, "ids_per_batch": a.ids,
           "bit_identical_first_1000_rows": all(torch.equal(v, ref) for v in finals.values()),
           "configs": [{"name": n, "depth": dep, "ids_per_s_median": statistics.median(rates[n]),
                        "ids_per_s_rounds": rates[n], **info.get(n, {})} for n, dep, _ in configs]}  # type: ignore[dict-item]
    base = {c["name"]: c["ids_per_s_median"] for c in out["configs"]}
    for c in out["configs"]:
        print(f"{c['name']:10s} {c['ids_per_s_median']:9.0f} ids/s  x{c['ids_per_s_median'] / base['reactive']:.2f} "
              f"of reactive, x{c['ids_per_s_median'] / base['depth_1']:.2f} of depth 1, "
              f"x{c['ids_per_s_median'] / base['dram']:.2f} of dram")
    print(f"bit-identical: {out['bit_identical_first_1000_rows']}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
