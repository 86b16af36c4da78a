"""`python -m train [--preset tiny] [flags]`: pre-train, then plot the run."""

from __future__ import annotations

import os
import sys
import time

from train.config import from_args


def main(argv: list[str] | None = None) -> None:
  try:
    cfg = from_args(argv)
  except ValueError as e:
    raise SystemExit(f"error: {e}")
  from train.sharding import initialize_distributed
  try:
    initialize_distributed(cfg.coordinator, cfg.num_processes, cfg.process_id)
  except ValueError as e:
    raise SystemExit(f"error: {e}")
  from train.loop import NonFiniteError, train  # after argument parsing: jax is slow to import
  from train.plot import plot

  t0 = time.perf_counter()
  try:
    last = train(cfg)
  except NonFiniteError as e:
    raise SystemExit(f"error: {e}")
  except ValueError as e:
    raise SystemExit(f"error: {e}")
  import jax
  if jax.process_index() != 0:
    return  # process 0 writes the plot and the summary
  png = plot([cfg.run_dir], os.path.join(cfg.run_dir, "loss.png"))
  print(f"done in {time.perf_counter() - t0:.0f}s: step {last.get('step')}, "
        f"loss {last.get('loss', float('nan')):.4f}, val_loss "
        f"{last.get('val_loss', float('nan')):.4f}; plot {png}", file=sys.stderr)


if __name__ == "__main__":
  main()
