"""Draws a model's loss curve from its train_log.json: python3 plot_loss.py MODEL_DIR (writes loss.png)."""
import json
import math
import os
import sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

model_dir = sys.argv[1]
with open(os.path.join(model_dir, "train_log.json")) as f:
    log = json.load(f)
steps = [e["step"] for e in log["log"]]
bits = [e["train_loss"] / math.log(2) for e in log["log"]]
fig, ax = plt.subplots(figsize=(6, 3.2), dpi=110)
ax.plot(steps, bits, label="training loss (bits per byte, one batch)")
ax.axhline(log["held_out_bits_per_byte"], color="C1", linestyle="--",
           label=f"held-out, end of training: {log['held_out_bits_per_byte']:.3f}")
ax.set_xlabel(f"step ({log['settings']['batch']} sequences × {log['settings']['seq_len']} bytes)")
ax.set_ylabel("bits per byte")
ax.set_ylim(0, 5)
ax.grid(alpha=0.3)
ax.legend()
fig.tight_layout()
fig.savefig(os.path.join(model_dir, "loss.png"))
