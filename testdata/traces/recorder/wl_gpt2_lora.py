# LoRA fine-tune of a GPT-2 medium config: frozen bf16 weights, rank-16 adapters (fp32) on the
# attention and MLP projections, batches of about 8192 tokens at a sequence length that changes
# every step (64..1024), so activation sizes change every step.
import os, random, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import common_torch as ct
MODE = ct.start_recording()


class LoRA(torch.nn.Module):
    def __init__(self, base, r=16, alpha=32):
        super().__init__()
        self.base = base
        nx, nf = base.weight.shape  # transformers' Conv1D keeps (in, out)
        self.A = torch.nn.Parameter(torch.randn(nx, r, device="cuda") * 0.01)
        self.B = torch.nn.Parameter(torch.zeros(r, nf, device="cuda"))
        self.s = alpha / r

    def forward(self, x):
        return self.base(x) + ((x.float() @ self.A) @ self.B * self.s).to(x.dtype)


def run():
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=50257, n_positions=1024, n_embd=1024, n_layer=24, n_head=16)
    model = GPT2LMHeadModel(cfg).to(device="cuda", dtype=torch.bfloat16)
    for p in model.parameters():
        p.requires_grad_(False)
    for blk in model.transformer.h:
        blk.attn.c_attn = LoRA(blk.attn.c_attn)
        blk.attn.c_proj = LoRA(blk.attn.c_proj)
        blk.mlp.c_fc = LoRA(blk.mlp.c_fc)
        blk.mlp.c_proj = LoRA(blk.mlp.c_proj)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=2e-4)
    rng = random.Random(3)
    lengths = []

    def step(i):
        L = rng.choice(range(64, 1025, 64))
        B = max(1, 8192 // L)
        lengths.append(L)
        ids = torch.randint(0, cfg.vocab_size, (B, L), device="cuda")
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    iters, secs = ct.loop(step, target_events=110000, max_iters=200, time_limit=60)
    return dict(iterations=iters, loop_s=round(secs, 2), model="GPT-2 medium config (355M), random init, bf16 frozen",
                lora="rank 16, alpha 32, fp32 adapters on attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj",
                trainable=sum(p.numel() for p in params), batching="8192 tokens per step, seq length uniform in 64..1024 step 64",
                lengths=lengths[:20], transformers=transformers.__version__)


try:
    extra = run()
except Exception as e:
    import traceback; traceback.print_exc()
    extra = dict(error=repr(e)[:500])
extra["record_mode"] = MODE
ct.finish("gpt2m_lora_varlen_bf16", sys.argv[1], extra)
