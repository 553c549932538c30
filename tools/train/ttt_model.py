"""The TTT language model of the spec (TTT-Linear and TTT-MLP, both backbones), in PyTorch, for
training. Its forward pass over whole sequences must reproduce the golden vectors.

Parameters use the checkpoint names of the spec's §5, so a trained model is saved as the C++
server loads it.
"""
import json
import math

import torch
import torch.nn.functional as F
from torch import nn

DEFAULTS = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5504, num_hidden_layers=24,
                num_attention_heads=32, rms_norm_eps=1e-6, tie_word_embeddings=True,
                rope_theta=10000.0, use_gate=False, share_qk=False, ttt_layer_type="linear",
                ttt_base_lr=1.0, mini_batch_size=16, pre_conv=False, conv_kernel=4,
                bos_token_id=1, eos_token_id=2)
LN_EPS = 1e-6  # Inner LayerNorm and PostLN.


class Config:
    def __init__(self, **fields):
        for key, value in {**DEFAULTS, **fields}.items():
            setattr(self, key, value)
        self.extra = {k: v for k, v in fields.items() if k not in DEFAULTS}
        self.head_dim = self.hidden_size // self.num_attention_heads
        self.mlp = self.ttt_layer_type == "mlp"
        self.inner_width = 4 * self.head_dim if self.mlp else self.head_dim

    @staticmethod
    def load(path):
        with open(path) as f:
            return Config(**json.load(f))

    def to_json(self):
        fields = {key: getattr(self, key) for key in DEFAULTS}
        fields.update(self.extra)
        fields.update(model_type="ttt", architectures=["TTTForCausalLM"])
        return json.dumps(fields, indent=2, sort_keys=True)


def rms_norm(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def gelu(x):
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608 * (x + 0.044715 * x * x * x)))


def causal_conv(x, weight, bias):
    """Depthwise causal conv over time: x [B, T, D], weight [D, 1, ck]; tap ck-1 is the current token."""
    t = x.shape[1]
    out = F.conv1d(x.transpose(1, 2), weight, bias, padding=weight.shape[-1] - 1,
                   groups=x.shape[-1])
    return out[..., :t].transpose(1, 2)


def layer_norm(z, gamma, beta):
    mean = z.mean(-1, keepdim=True)
    centered = z - mean
    std = torch.sqrt(centered.pow(2).mean(-1, keepdim=True) + LN_EPS)
    return gamma * centered / std + beta


def ln_l2_grad(z, target, gamma, beta):
    """∂/∂z of ½‖LN(z) − target‖² (spec §3.5), row-wise over the last axis."""
    f = z.shape[-1]
    mean = z.mean(-1, keepdim=True)
    centered = z - mean
    std = torch.sqrt(centered.pow(2).mean(-1, keepdim=True) + LN_EPS)
    xhat = centered / std
    e = gamma * (gamma * xhat + beta - target)
    return (f * e - e.sum(-1, keepdim=True) - xhat * (e * xhat).sum(-1, keepdim=True)) / (f * std)


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        d, nh, f, f1, ck = c.hidden_size, c.num_attention_heads, c.head_dim, c.inner_width, c.conv_kernel
        p = {}
        if c.pre_conv:
            p["conv.norm.weight"] = torch.ones(d)
            p["conv.conv.weight"] = torch.randn(d, 1, ck) * 0.5
            p["conv.conv.bias"] = torch.zeros(d)
        p["seq_norm.weight"] = torch.ones(d)
        s = "seq_modeling_block."
        for name in ["q_proj", "v_proj", "o_proj"] + ([] if c.share_qk else ["k_proj"]) + \
                    (["g_proj"] if c.use_gate else []):
            p[s + name + ".weight"] = torch.randn(d, d) / math.sqrt(d)
        if c.share_qk:
            for name in ("conv_q", "conv_k"):
                p[s + name + ".weight"] = torch.randn(d, 1, ck) * 0.5
                p[s + name + ".bias"] = torch.zeros(d)
        p[s + "learnable_ttt_lr_weight"] = torch.randn(nh, 1, d) * 0.02
        p[s + "learnable_ttt_lr_bias"] = torch.zeros(nh, 1)
        p[s + "learnable_token_idx"] = torch.zeros(c.mini_batch_size)
        p[s + "ttt_norm_weight"] = torch.ones(nh, f)
        p[s + "ttt_norm_bias"] = torch.zeros(nh, f)
        p[s + "post_norm.weight"] = torch.ones(d)
        p[s + "post_norm.bias"] = torch.zeros(d)
        p[s + "W1"] = torch.randn(nh, f, f1) * 0.02
        p[s + "b1"] = torch.zeros(nh, 1, f1)
        if c.mlp:
            p[s + "W2"] = torch.randn(nh, f1, f) * 0.02
            p[s + "b2"] = torch.zeros(nh, 1, f)
        i = c.intermediate_size
        p["ffn_norm.weight"] = torch.ones(d)
        p["mlp.gate_proj.weight"] = torch.randn(i, d) / math.sqrt(d)
        p["mlp.up_proj.weight"] = torch.randn(i, d) / math.sqrt(d)
        p["mlp.down_proj.weight"] = torch.randn(d, i) / math.sqrt(i) / math.sqrt(2 * c.num_hidden_layers)
        self.names = list(p)
        self.params = nn.ParameterList([nn.Parameter(v) for v in p.values()])

    def get(self, name):
        return self.params[self.names.index(name)]

    def ttt(self, x):
        c, s = self.c, "seq_modeling_block."
        w = lambda n: self.get(s + n)
        b, t, d = x.shape
        nh, f, k = c.num_attention_heads, c.head_dim, c.mini_batch_size
        if c.share_qk:
            a = x @ w("q_proj.weight").T
            q = causal_conv(a, w("conv_q.weight"), w("conv_q.bias"))
            kk = causal_conv(a, w("conv_k.weight"), w("conv_k.bias"))
        else:
            q, kk = x @ w("q_proj.weight").T, x @ w("k_proj.weight").T
        v = x @ w("v_proj.weight").T
        heads = lambda y: y.view(b, t, nh, f).transpose(1, 2)  # [B, nh, T, f]
        q, kk, v = heads(q), heads(kk), heads(v)
        # RoPE at p = t mod K, interleaved pairs; float32 frequencies as the reference.
        omega = 1.0 / (c.rope_theta ** (torch.arange(0, f, 2, device=x.device).float() / f))
        pos = (torch.arange(t, device=x.device) % k).float()
        angle = pos[:, None] * omega[None, :]
        cos, sin = torch.cos(angle), torch.sin(angle)

        def rope(y):
            y0, y1 = y[..., 0::2], y[..., 1::2]
            return torch.stack((y0 * cos - y1 * sin, y1 * cos + y0 * sin), -1).flatten(-2)
        q, kk = rope(q), rope(kk)
        lr = torch.einsum("btd,hd->bht", x, w("learnable_ttt_lr_weight")[:, 0, :])
        lr = c.ttt_base_lr * torch.sigmoid(lr + w("learnable_ttt_lr_bias")) / f  # [B, nh, T]
        tau = torch.clamp(1.0 / torch.arange(1, k + 1, device=x.device).float()
                          + w("learnable_token_idx"), min=0.0)
        gamma = w("ttt_norm_weight")[None, :, None, :]
        beta = w("ttt_norm_bias")[None, :, None, :]
        W1 = w("W1")[None].expand(b, -1, -1, -1)
        b1 = w("b1")[None].expand(b, -1, -1, -1)
        if c.mlp:
            W2 = w("W2")[None].expand(b, -1, -1, -1)
            b2 = w("b2")[None].expand(b, -1, -1, -1)
        outs = []
        for start in range(0, t, k):
            m = min(k, t - start)
            qw, kw, vw = q[:, :, start:start + m], kk[:, :, start:start + m], v[:, :, start:start + m]
            lrw = lr[:, :, start:start + m]
            eta = torch.tril(tau[:m, None] * lrw[:, :, None, :])  # [B, nh, m, m]: τ_i · lr_j, j ≤ i
            target = vw - kw
            z1 = kw @ W1 + b1
            if not c.mlp:
                g1 = ln_l2_grad(z1, target, gamma, beta)
                zbar = qw @ W1 + b1 - (eta * torch.tril(qw @ kw.transpose(-1, -2) + 1)) @ g1
            else:
                x2 = gelu(z1)
                z2 = x2 @ W2 + b2
                g2 = ln_l2_grad(z2, target, gamma, beta)
                g1 = (g2 @ W2.transpose(-1, -2)) * gelu_derivative(z1)
                zbar1 = qw @ W1 + b1 - (eta * torch.tril(qw @ kw.transpose(-1, -2) + 1)) @ g1
                x2bar = gelu(zbar1)
                zbar = x2bar @ W2 + b2 - (eta * torch.tril(x2bar @ x2.transpose(-1, -2) + 1)) @ g2
            outs.append(qw + layer_norm(zbar, gamma, beta))
            if m == k:  # Commit θ̄ of the window's last token.
                wl = (tau[k - 1] * lrw)[..., None]  # [B, nh, K, 1]
                W1 = W1 - kw.transpose(-1, -2) @ (wl * g1)
                b1 = b1 - (wl * g1).sum(-2, keepdim=True)
                if c.mlp:
                    W2 = W2 - x2.transpose(-1, -2) @ (wl * g2)
                    b2 = b2 - (wl * g2).sum(-2, keepdim=True)
        out = torch.cat(outs, 2).transpose(1, 2).reshape(b, t, d)
        y = F.layer_norm(out, (d,), w("post_norm.weight"), w("post_norm.bias"), LN_EPS)
        if c.use_gate:
            y = gelu(x @ w("g_proj.weight").T) * y
        return y @ w("o_proj.weight").T

    def forward(self, h):
        c = self.c
        if c.pre_conv:
            h = h + causal_conv(rms_norm(h, self.get("conv.norm.weight"), c.rms_norm_eps),
                                self.get("conv.conv.weight"), self.get("conv.conv.bias"))
        h = h + self.ttt(rms_norm(h, self.get("seq_norm.weight"), c.rms_norm_eps))
        u = rms_norm(h, self.get("ffn_norm.weight"), c.rms_norm_eps)
        act = F.silu(u @ self.get("mlp.gate_proj.weight").T) * (u @ self.get("mlp.up_proj.weight").T)
        return h + act @ self.get("mlp.down_proj.weight").T


def gelu_derivative(x):
    t = torch.tanh(0.7978845608 * (x + 0.044715 * x * x * x))
    return 0.5 * x * (1 - t * t) * (0.7978845608 + 0.1070322243 * x * x) + 0.5 * (1 + t)


class TTTModel(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.embed = nn.Parameter(torch.randn(c.vocab_size, c.hidden_size) * 0.02)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.num_hidden_layers))
        self.norm = nn.Parameter(torch.ones(c.hidden_size))
        self.lm_head = None if c.tie_word_embeddings else \
            nn.Parameter(torch.randn(c.vocab_size, c.hidden_size) * 0.02)

    def forward(self, ids):
        h = self.embed[ids]
        for block in self.blocks:
            h = block(h)
        head = self.embed if self.lm_head is None else self.lm_head
        return rms_norm(h, self.norm, self.c.rms_norm_eps) @ head.T

    def state_dict_for_checkpoint(self):
        tensors = {"model.embed_tokens.weight": self.embed, "model.norm.weight": self.norm}
        if self.lm_head is not None:
            tensors["lm_head.weight"] = self.lm_head
        for i, block in enumerate(self.blocks):
            for name in block.names:
                tensors[f"model.layers.{i}.{name}"] = block.get(name)
        return tensors

    def load_checkpoint(self, tensors):
        with torch.no_grad():
            self.embed.copy_(tensors["model.embed_tokens.weight"])
            self.norm.copy_(tensors["model.norm.weight"])
            if self.lm_head is not None:
                self.lm_head.copy_(tensors["lm_head.weight"])
            for i, block in enumerate(self.blocks):
                for name in block.names:
                    block.get(name).copy_(tensors[f"model.layers.{i}.{name}"])
