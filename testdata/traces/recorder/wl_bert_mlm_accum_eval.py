# BERT-style masked-language-model pretraining (BERT-base sizes built from torch.nn: token,
# position and segment embeddings, a 12-layer nn.TransformerEncoder, an MLM head tied to the token
# embedding, random init) on random token ids with dynamic padding: every micro-batch draws its
# own padded length (64..512) and batch (about 6k..12k tokens), 15% of the real tokens are masked
# and only those go through the vocabulary projection (a data-dependent size), gradients are
# accumulated over 1..4 micro-batches per optimizer step (the number drawn every step), then
# gradient clipping and AdamW; every third optimizer step an evaluation pass (eval mode,
# torch.no_grad) runs two batches at an evaluation batch size of its own. bf16 autocast throughout.
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import common_torch as ct
MODE = ct.start_recording()


def run():
    import random
    import torch.nn as nn
    import torch.nn.functional as F
    torch.manual_seed(5)
    rng = random.Random(5)
    V, D, H, NL, MAXL, MASK_ID = 30522, 768, 12, 12, 512, 103

    class MLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos, self.typ = nn.Embedding(V, D), nn.Embedding(MAXL, D), nn.Embedding(2, D)
            self.norm, self.drop = nn.LayerNorm(D), nn.Dropout(0.1)
            layer = nn.TransformerEncoderLayer(D, H, 4 * D, dropout=0.1, activation="gelu", batch_first=True)
            self.enc = nn.TransformerEncoder(layer, NL, enable_nested_tensor=False)
            self.head = nn.Sequential(nn.Linear(D, D), nn.GELU(), nn.LayerNorm(D))
            self.bias = nn.Parameter(torch.zeros(V))

        def forward(self, ids, typ, pad, sel):
            L = ids.shape[1]
            h = self.tok(ids) + self.pos(torch.arange(L, device=ids.device))[None] + self.typ(typ)
            h = self.enc(self.drop(self.norm(h)), src_key_padding_mask=pad)
            h = self.head(h[sel])  # only the masked positions: their count changes with every batch
            return F.linear(h, self.tok.weight, self.bias)  # decoder tied to the token embedding

    model = MLM().cuda().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.98), weight_decay=0.01)

    def batch(B, L):
        """Random sequences of L/2..L real tokens padded to L, two segments, BERT's 80/10/10 masking."""
        lens = torch.randint(max(8, L // 2), L + 1, (B,), device="cuda")
        lens[0] = L
        ar = torch.arange(L, device="cuda")
        pad = ar[None] >= lens[:, None]  # True = padding (nn.TransformerEncoder's convention)
        ids = torch.randint(1000, V, (B, L), device="cuda").masked_fill_(pad, 0)
        typ = ((ar[None] >= (lens[:, None] // 2)) & ~pad).long()
        sel = (torch.rand(B, L, device="cuda") < 0.15) & ~pad
        sel[:, 1] = True  # at least one masked token per sequence
        labels = ids[sel]
        r = torch.rand(B, L, device="cuda")
        inp = ids.masked_fill(sel & (r < 0.8), MASK_ID)
        inp = torch.where(sel & (r >= 0.8) & (r < 0.9), torch.randint_like(ids, 1000, V), inp)
        return inp, typ, pad, sel, labels

    lengths = list(range(64, MAXL + 1, 32))
    token_budgets = (6144, 8192, 12288)
    eval_batches = (24, 48, 96, 160)  # evaluation batch sizes, none equal to a training one by design
    eval_lengths = (128, 256, 384, 512)
    stats = dict(micro_batches=0, optimizer_steps=0, eval_passes=0, eval_batches=0, masked_tokens=0)
    accum_drawn, evals = [], []

    def evaluate():
        Be = rng.choice(eval_batches)
        model.eval()
        out = []
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for _ in range(2):
                L = rng.choice(eval_lengths)
                Bl = max(4, Be * 128 // L)  # the pass's batch size, scaled down for long sequences
                inp, typ, pad, sel, labels = batch(Bl, L)
                logits = model(inp, typ, pad, sel)
                loss = F.cross_entropy(logits, labels)
                acc = (logits.argmax(-1) == labels).float().mean()
                out.append((Bl, L, round(loss.item(), 3), round(acc.item(), 4)))
                stats["eval_batches"] += 1
                del inp, typ, pad, sel, labels, logits, loss, acc
        model.train()
        stats["eval_passes"] += 1
        evals.append(out)

    def step(i):
        n = rng.choice((1, 2, 3, 4))
        accum_drawn.append(n)
        for _ in range(n):
            L = rng.choice(lengths)
            B = max(2, rng.choice(token_budgets) // L)
            inp, typ, pad, sel, labels = batch(B, L)
            stats["masked_tokens"] += labels.numel()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(inp, typ, pad, sel)
                loss = F.cross_entropy(logits, labels) / n
            loss.backward()
            stats["micro_batches"] += 1
            del inp, typ, pad, sel, labels, logits, loss
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        stats["optimizer_steps"] += 1
        if i % 3 == 2:
            evaluate()

    iters, secs = ct.loop(step, target_events=100000, max_iters=400, time_limit=60)
    return dict(iterations=iters, loop_s=round(secs, 2), accum_drawn=accum_drawn[:30], evals=evals[:6],
                model="BERT-base sizes from torch.nn (vocab 30522, d 768, 12 heads, 12 nn.TransformerEncoderLayer post-norm GELU, tied MLM head), random init",
                batching="per micro-batch: padded length 64..512 step 32, batch = max(2, {6144, 8192, 12288} // length), real lengths L/2..L; 15% masking (80/10/10), loss on masked positions only",
                accumulation="1..4 micro-batches per optimizer step, drawn every step; clip_grad_norm 1.0; AdamW",
                evaluation="every 3rd optimizer step: eval mode + no_grad, 2 batches at a pass batch size from {24, 48, 96, 160} (x 128/length), lengths {128..512}",
                precision="fp32 weights, bf16 autocast", **stats)


try:
    extra = run()
except Exception as e:  # keep the partial (still real) trace
    import traceback; traceback.print_exc()
    extra = dict(error=repr(e)[:500])
extra["record_mode"] = MODE
ct.finish("bert_base_mlm_accum_eval_varlen_bf16", sys.argv[1], extra)
