#!/usr/bin/env python3
"""Per-step losses of bin/bench.py rows, compared pairwise as in docs/benchmarks.md's loss tables.

    python3 docs/bench/compare_losses.py docs/bench/s8/loss.jsonl [LABEL ...]   # default: every row, the first as reference

For each row against the reference: step-1 losses, the largest and mean absolute difference over the steps both ran
(and where the largest is), the first step differing by more than 0.005, the mean of each run's last 10 steps.
"""
import json
import sys


def main() -> int:
    path, labels = sys.argv[1], sys.argv[2:]
    rows = {r["label"]: r for r in map(json.loads, open(path))}
    order = labels or list(rows)
    ref = rows[order[0]]
    print("| pair | micro x accum | steps | step-1 losses | largest difference (step) | mean difference "
          "| first step > 0.005 | mean of the last 10 steps |")
    print("|---|---|---|---|---|---|---|---|")
    for label in order[1:]:
        r = rows[label]
        a, b = ref["losses"], r["losses"]
        n = min(len(a), len(b))
        d = [abs(x - y) for x, y in zip(a[:n], b[:n])]
        worst = max(range(n), key=d.__getitem__)
        first = next((i + 1 for i, x in enumerate(d) if x > 0.005), "-")
        print(f"| {ref['label']} vs {label} | {ref['micro']}x{ref['accum']} / {r['micro']}x{r['accum']} | {n} "
              f"| {a[0]:.4f} / {b[0]:.4f} | {d[worst]:.4f} ({100 * d[worst] / a[worst]:.1f}%, step {worst + 1}) "
              f"| {sum(d) / n:.4f} | {first} | {sum(a[n - 10:n]) / 10:.4f} / {sum(b[n - 10:n]) / 10:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
