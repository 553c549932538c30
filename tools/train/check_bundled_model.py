"""The bundled model in the C++ engine equals the training program:
  - logits on held-out text within 1e-3 (prompt at once and token by token, via ttt-generate);
  - held-out bits per byte (ttt-generate --eval-text) within 1% of what training recorded;
  - ttt-generate uses it when no model is named.

Usage: python3 check_bundled_model.py GENERATE_BIN MODEL_DIR   (exit 77 when torch is missing)
"""
import json
import os
import subprocess
import sys
import tempfile

try:
    import torch
except ImportError:
    print("SKIPPED: python3-torch is not installed")
    sys.exit(77)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_io  # noqa: E402
from ttt_model import Config, TTTModel  # noqa: E402


def check(condition, message):
    print(("ok: " if condition else "FAILED: ") + message)
    if not condition:
        sys.exit(1)


def run(args):
    result = subprocess.run(args, capture_output=True, text=True, check=False)
    check(result.returncode == 0, " ".join(os.path.basename(a) for a in args[:3]) + " ran "
          + result.stderr.strip()[-300:])
    return result.stdout


def main(generate, model_dir):
    config = Config.load(os.path.join(model_dir, "config.json"))
    model = TTTModel(config)
    model.load_checkpoint(safetensors_io.load(os.path.join(model_dir, "model.safetensors")))
    with open(os.path.join(model_dir, "heldout.txt"), "rb") as f:
        held_out = f.read()
    ids = [config.bos_token_id] + [b + config.byte_token_offset for b in held_out[:400]]
    with torch.no_grad():
        reference = model(torch.tensor([ids]))[0]
    out = tempfile.mkdtemp()
    for chunk in (0, 1):
        path = os.path.join(out, f"logits-{chunk}.safetensors")
        run([generate, "--model", model_dir, "--prompt-ids", ",".join(map(str, ids)),
             "--max-new-tokens", "0", "--chunk", str(chunk), "--logits-out", path])
        worst = (safetensors_io.load(path)["logits"] - reference).abs().max().item()
        check(worst <= 1e-3, f"C++ logits, chunk {chunk or 'all'}: max |Δ| {worst:.3g} ≤ 1e-3")

    with open(os.path.join(model_dir, "train_log.json")) as f:
        recorded = json.load(f)["held_out_bits_per_byte"]
    measured = json.loads(run([generate, "--model", model_dir, "--eval-text",
                               os.path.join(model_dir, "heldout.txt")]))["bits_per_byte"]
    check(abs(measured - recorded) <= 0.01 * recorded,
          f"held-out bits per byte: C++ {measured:.4f}, training {recorded:.4f}")

    text = run([generate, "--prompt", "In the beginning", "--max-new-tokens", "8"])
    check(len(text.strip()) > 0, "ttt-generate runs the bundled model by default")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
