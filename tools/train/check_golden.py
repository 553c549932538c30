"""The training program's forward reproduces every golden model's prefill logits (1e-3 max-abs).

Usage: python3 check_golden.py GOLDEN_DIR   (exit 77 when torch is missing)
"""
import os
import sys

try:
    import torch
except ImportError:
    print("SKIPPED: python3-torch is not installed")
    sys.exit(77)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_io  # noqa: E402
from ttt_model import Config, TTTModel  # noqa: E402


def main(golden_root):
    worst_overall = 0.0
    for name in sorted(os.listdir(golden_root)):
        folder = os.path.join(golden_root, name)
        if not os.path.isfile(os.path.join(folder, "golden.safetensors")):
            continue
        config = Config.load(os.path.join(folder, "config.json"))
        model = TTTModel(config)
        model.load_checkpoint(safetensors_io.load(os.path.join(folder, "model.safetensors")))
        golden = safetensors_io.load(os.path.join(folder, "golden.safetensors"))
        with torch.no_grad():
            logits = model(golden["input_ids"].long())
        worst = (logits - golden["prefill_logits"]).abs().max().item()
        print(f"{name}: max |logits - prefill_logits| = {worst:.3g}")
        worst_overall = max(worst_overall, worst)
    ok = worst_overall <= 1e-3
    print("ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
