"""Random 4 KiB page reads from a disk-tier file (store/row_file.py) at several reads in
flight: what the disk gives the NVMe tier here (latency at one read in flight, reads/s with
many). Run: ``python benchmarks/disk_probe.py [--dir D] [--mb 512] [--json F]``."""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import numpy as np

from torchrec_proactive.store.row_file import BLOCK, RowFile, aligned_buffer


def probe(directory: str, mb: int, depths=(1, 4, 16, 64), reads: int = 4000, seed: int = 0) -> dict:
    rows = mb * 2**20 // 512
    out = {"file_mb": mb, "depths": []}
    with RowFile(f"{directory}/probe.rows", num_rows=rows, row_bytes=512, table="probe", io_threads=max(depths),
                 max_run_pages=1) as f:
        out["o_direct"], out["fallback_reason"] = f.o_direct, f.fallback_reason
        # Fill the file so reads hit real blocks, not holes.
        chunk = aligned_buffer(256 * BLOCK)
        chunk[:] = 1
        for first in range(0, f.num_pages, 256):
            n = min(256, f.num_pages - first)
            f.write_pages(np.arange(first, first + n), chunk).wait()
        rng = np.random.default_rng(seed)
        for depth in depths:
            buf = aligned_buffer(depth * BLOCK)
            t0 = time.perf_counter()
            done = 0
            while done < reads:
                pages = np.sort(rng.choice(f.num_pages, size=depth, replace=False))
                f.read_pages(pages, buf).wait()  # depth reads in flight, one request each
                done += depth
            dt = time.perf_counter() - t0
            out["depths"].append({"in_flight": depth, "reads_per_s": done / dt, "us_per_batch": dt / (done / depth) * 1e6})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        res = probe(d, a.mb)
    for r in res["depths"]:
        print(f"{r['in_flight']:3d} in flight: {r['reads_per_s']:9.0f} reads/s, {r['us_per_batch']:8.0f} us per batch")
    print(f"O_DIRECT: {res['o_direct']}" + (f" ({res['fallback_reason']})" if res["fallback_reason"] else ""))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
