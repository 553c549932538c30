"""Trains the bundled default model: TTT-Linear, Mamba backbone, byte-level tokens, on the corpus
of gather_text.sh, within a time budget; holds out every 50th 4 KiB block for evaluation.

Usage: python3 train.py --data corpus.txt --out models/NAME [--minutes 4] [--device cuda]

Writes the model directory the server loads (config.json declaring the byte tokenizer,
model.safetensors in float32) and train_log.json (settings, loss per logged step, held-out bits per
byte).
"""
import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_io  # noqa: E402
from ttt_model import Config, TTTModel  # noqa: E402

BYTE_OFFSET = 3  # Byte b is token b + 3; 0, 1 (BOS), 2 (EOS) are special.
BLOCK = 4096     # Held-out granularity: every 50th block of the corpus.
HELD_OUT_EVERY = 50
EVAL_WINDOW = 1024


def split(data):
    train, held_out = bytearray(), bytearray()
    for i in range(0, len(data), BLOCK):
        (held_out if (i // BLOCK) % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else train).extend(
            data[i:i + BLOCK])
    return bytes(train), bytes(held_out)


def held_out_windows(held_out):
    """BOS + EVAL_WINDOW bytes per window; the model is scored on every byte of each window."""
    windows = []
    for i in range(0, len(held_out) - EVAL_WINDOW + 1, EVAL_WINDOW):
        windows.append([1] + [b + BYTE_OFFSET for b in held_out[i:i + EVAL_WINDOW]])
    return torch.tensor(windows)


@torch.no_grad()
def bits_per_byte(model, windows, device, batch=32):
    total, count = 0.0, 0
    for i in range(0, len(windows), batch):
        ids = windows[i:i + batch].to(device)
        logits = model(ids[:, :-1]).float()
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                 reduction="sum").item()
        count += ids[:, 1:].numel()
    return total / count / math.log(2)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--minutes", type=float, default=4.0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    with open(args.data, "rb") as f:
        train, held_out = split(f.read())
    train_tokens = torch.tensor(list(train), dtype=torch.long) + BYTE_OFFSET
    windows = held_out_windows(held_out)
    config = Config(vocab_size=256 + BYTE_OFFSET, hidden_size=args.hidden,
                    intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                    num_attention_heads=args.heads, share_qk=True, use_gate=True, pre_conv=True,
                    tie_word_embeddings=True, ttt_layer_type="linear", ttt_base_lr=1.0,
                    mini_batch_size=16, max_position_embeddings=2048, tokenizer_type="byte",
                    byte_token_offset=BYTE_OFFSET)
    model = TTTModel(config).to(args.device)
    parameters = sum(p.numel() for p in model.parameters())
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1},
                                   {"params": others, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95))
    budget = args.minutes * 60
    warmup = 100
    log, step, start = [], 0, time.time()
    generator = torch.Generator().manual_seed(args.seed)
    print(f"{parameters} parameters; {len(train)} training bytes, {len(held_out)} held out",
          flush=True)
    while True:
        elapsed = time.time() - start
        if elapsed >= budget:
            break
        # Warm-up, then cosine decay over the time budget to a tenth.
        progress = elapsed / budget
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(train_tokens) - args.seq_len, (args.batch,),
                               generator=generator)
        rows = torch.stack([train_tokens[s:s + args.seq_len] for s in starts.tolist()])
        ids = torch.cat([torch.ones(args.batch, 1, dtype=torch.long), rows], 1).to(args.device)
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        if step % 25 == 0:
            entry = {"step": step, "seconds": round(time.time() - start, 2),
                     "train_loss": round(loss.item(), 4), "lr": lr}
            log.append(entry)
            print(json.dumps(entry), flush=True)
    model.eval()
    bpb = bits_per_byte(model, windows, args.device)
    print(f"held-out bits per byte: {bpb:.4f} ({len(windows)} windows of {EVAL_WINDOW} bytes)",
          flush=True)

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        f.write(config.to_json() + "\n")
    safetensors_io.save(os.path.join(args.out, "model.safetensors"),
                        model.state_dict_for_checkpoint())
    with open(os.path.join(args.out, "train_log.json"), "w") as f:
        json.dump({"command": " ".join(sys.argv), "settings": vars(args), "parameters": parameters,
                   "training_bytes": len(train), "held_out_bytes": len(held_out),
                   "held_out_split": f"every {HELD_OUT_EVERY}th block of {BLOCK} bytes",
                   "eval_window_bytes": EVAL_WINDOW, "steps": step,
                   "held_out_bits_per_byte": bpb, "torch": torch.__version__,
                   "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                   "log": log}, f, indent=1)


if __name__ == "__main__":
    main()
