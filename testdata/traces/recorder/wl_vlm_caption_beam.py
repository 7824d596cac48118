# A vision-language captioning model trained on the default stream from one thread: a ViT-style
# image encoder (patch 16) over 1..4 images a sample at a resolution drawn every step (224, 288,
# 336 or 384, the position embedding resized to the step's grid), a projector into the text
# decoder's width, and a GPT-style decoder whose blocks attend causally to the caption and, through
# cross-attention with a padding mask, to the sample's image tokens; the caption length is drawn
# every step from 8..96 tokens. bf16 autocast, AdamW, gradient checkpointing on every second
# decoder block. Every fifth step, after the training step, an inference pass under no_grad
# captions a batch of its own by beam search (4 beams, up to 40 new tokens): the image tokens are
# repeated per beam and their cross-attention keys and values computed once, while each beam's
# self-attention key/value cache grows by one position a token and is reordered with index_select
# after every step, as generation code does.
import os, random, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import common_torch as ct
MODE = ct.start_recording()


def run():
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint
    torch.manual_seed(7)
    rng = random.Random(7)
    P, RES, MAXIMG = 16, (224, 288, 336, 384), 4
    DV, HV, LV = 768, 12, 8             # image encoder
    DT, HT, LT, V = 1024, 16, 6, 32000  # text decoder
    HD, MAXLEN, BOS, EOS = DT // HT, 128, 1, 2
    BEAM, MAXNEW = 4, 40
    IMG_TOK = 40 * (224 // P) ** 2      # samples a training step: 40 at 224 .. 13 at 384
    BEAM_TOK = 8 * (224 // P) ** 2      # samples a beam-search pass: 8 at 224 .. 2 at 384

    def heads(z, h):  # (B, N, h*d) -> (B, h, N, d)
        return z.view(z.shape[0], z.shape[1], h, -1).transpose(1, 2)

    def merge(a):  # (B, h, N, d) -> (B, N, h*d)
        return a.transpose(1, 2).reshape(a.shape[0], a.shape[2], -1)

    class VBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.n1, self.n2 = nn.LayerNorm(DV), nn.LayerNorm(DV)
            self.qkv, self.o = nn.Linear(DV, 3 * DV), nn.Linear(DV, DV)
            self.mlp = nn.Sequential(nn.Linear(DV, 4 * DV), nn.GELU(), nn.Linear(4 * DV, DV))

        def forward(self, x):
            B, N, _ = x.shape
            q, k, v = self.qkv(self.n1(x)).view(B, N, 3, HV, DV // HV).permute(2, 0, 3, 1, 4)
            x = x + self.o(merge(F.scaled_dot_product_attention(q, k, v)))
            return x + self.mlp(self.n2(x))

    class DBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.n1, self.n2, self.n3 = nn.LayerNorm(DT), nn.LayerNorm(DT), nn.LayerNorm(DT)
            self.qkv, self.o = nn.Linear(DT, 3 * DT), nn.Linear(DT, DT)
            self.cq, self.ckv, self.co = nn.Linear(DT, DT), nn.Linear(DT, 2 * DT), nn.Linear(DT, DT)
            self.mlp = nn.Sequential(nn.Linear(DT, 4 * DT), nn.GELU(), nn.Linear(4 * DT, DT))

        def cross_kv(self, mem):  # the image tokens' keys and values, (B, HT, S, HD) each
            k, v = self.ckv(mem).chunk(2, -1)
            return heads(k, HT), heads(v, HT)

        def run(self, x, mem_kv, mask, cache):
            B, N, _ = x.shape
            q, k, v = self.qkv(self.n1(x)).view(B, N, 3, HT, HD).permute(2, 0, 3, 1, 4)
            if cache is not None:  # decoding: this token's key and value after the beam's earlier ones
                k = torch.cat([cache[0], k], 2)
                v = torch.cat([cache[1], v], 2)
            x = x + self.o(merge(F.scaled_dot_product_attention(q, k, v, is_causal=cache is None)))
            ck, cv = mem_kv
            a = F.scaled_dot_product_attention(heads(self.cq(self.n2(x)), HT), ck, cv, attn_mask=mask)
            x = x + self.co(merge(a))
            return x + self.mlp(self.n3(x)), (k, v)

        def forward(self, x, mem, mask):  # training: the whole caption at once
            return self.run(x, self.cross_kv(mem), mask, None)[0]

    class VLM(nn.Module):
        def __init__(self):
            super().__init__()
            g = max(RES) // P
            self.patch = nn.Conv2d(3, DV, P, stride=P)
            self.vpos = nn.Parameter(torch.randn(1, DV, g, g) * 0.02)
            self.vblocks = nn.ModuleList(VBlock() for _ in range(LV))
            self.vnorm = nn.LayerNorm(DV)
            self.proj = nn.Sequential(nn.Linear(DV, DT), nn.GELU(), nn.Linear(DT, DT))
            self.slot = nn.Parameter(torch.randn(MAXIMG, DT) * 0.02)  # which of the sample's images
            self.emb, self.pos = nn.Embedding(V, DT), nn.Embedding(MAXLEN, DT)
            self.dblocks = nn.ModuleList(DBlock() for _ in range(LT))
            self.norm = nn.LayerNorm(DT)

        def encode(self, imgs, slot, B, maxn):
            # imgs: every image of the batch, (n, 3, R, R); slot: each one's place among B x maxn
            x = self.patch(imgs)
            g = x.shape[-1]
            pos = F.interpolate(self.vpos, size=(g, g), mode="bicubic", align_corners=False)
            x = (x + pos).flatten(2).transpose(1, 2)
            for b in self.vblocks:
                x = b(x)
            f = self.proj(self.vnorm(x))  # (n, g*g, DT)
            mem = f.new_zeros(B * maxn, g * g, DT).index_copy(0, slot, f)
            mem = mem.view(B, maxn, g * g, DT) + self.slot[:maxn, None, :].to(mem.dtype)
            return mem.view(B, maxn * g * g, DT)

        def forward(self, ids, mem, mask):
            x = self.emb(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
            for j, b in enumerate(self.dblocks):
                if j % 2 == 0:  # every second block's activations are recomputed in the backward pass
                    x = checkpoint(b, x, mem, mask, use_reentrant=False)
                else:
                    x = b(x, mem, mask)
            return F.linear(self.norm(x), self.emb.weight)

    model = VLM().cuda().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05)
    finished = torch.full((V,), float("-inf"), device="cuda")
    finished[EOS] = 0.0  # a finished beam only goes on with EOS, at no cost
    stats = dict(beam_passes=0, beam_tokens=0, images=0)
    drawn = []

    def images(B, R):
        n = [rng.randint(1, MAXIMG) for _ in range(B)]
        maxn, g2 = max(n), (R // P) ** 2
        imgs = torch.randn(sum(n), 3, R, R, device="cuda")
        slot = torch.tensor([b * maxn + j for b in range(B) for j in range(n[b])], device="cuda")
        have = torch.arange(maxn, device="cuda")[None, :] < torch.tensor(n, device="cuda")[:, None]
        mask = have.repeat_interleave(g2, 1)[:, None, None, :]  # (B, 1, 1, maxn*g2): padding slots masked
        stats["images"] += sum(n)
        return imgs, slot, mask, maxn

    @torch.no_grad()
    def beam_search():
        model.eval()
        R = rng.choice(RES)
        Bi = max(1, BEAM_TOK // (R // P) ** 2)
        imgs, slot, mask, maxn = images(Bi, R)
        base = (torch.arange(Bi, device="cuda") * BEAM)[:, None]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            mem = model.encode(imgs, slot, Bi, maxn).repeat_interleave(BEAM, 0)
            mask = mask.repeat_interleave(BEAM, 0)
            mem_kv = [b.cross_kv(mem) for b in model.dblocks]
            del imgs, slot, mem
            tok = torch.full((Bi * BEAM, 1), BOS, dtype=torch.long, device="cuda")
            seqs = tok
            scores = torch.zeros(Bi, BEAM, device="cuda")
            scores[:, 1:] = -1e9  # the first step extends the first beam only
            scores = scores.view(-1)
            done = torch.zeros(Bi * BEAM, dtype=torch.bool, device="cuda")
            caches = [None] * LT
            for t in range(MAXNEW):
                x = model.emb(tok) + model.pos.weight[t]
                for j, b in enumerate(model.dblocks):
                    x, caches[j] = b.run(x, mem_kv[j], mask, caches[j])
                logp = F.linear(model.norm(x[:, -1]), model.emb.weight).float().log_softmax(-1)
                logp = torch.where(done[:, None], finished, logp)
                top, idx = (scores[:, None] + logp).view(Bi, BEAM * V).topk(BEAM, -1)
                src = (idx // V + base).view(-1)  # the beam each of the new beams extends
                tok = (idx % V).view(-1, 1)
                scores = top.view(-1)
                seqs = torch.cat([seqs.index_select(0, src), tok], 1)
                done = done.index_select(0, src) | (tok[:, 0] == EOS)
                caches = [(k.index_select(0, src), v.index_select(0, src)) for k, v in caches]
                del x, logp, top, idx, src
                if bool(done.all()):
                    break
            best = seqs.view(Bi, BEAM, -1)[:, 0].cpu()  # topk sorts: beam 0 scores best
        stats["beam_passes"] += 1
        stats["beam_tokens"] += Bi * (best.shape[1] - 1)
        del mem_kv, caches, seqs, scores, done, tok, mask
        model.train()

    def step(i):
        R = rng.choice(RES)
        B = max(2, IMG_TOK // (R // P) ** 2)
        T = rng.randint(8, 96)
        drawn.append((R, B, T))
        imgs, slot, mask, maxn = images(B, R)
        ids = torch.randint(0, V, (B, T + 1), device="cuda")
        lens = torch.randint(max(1, T // 2), T + 1, (B,), device="cuda")
        real = torch.arange(T + 1, device="cuda")[None, :] < lens[:, None]
        tgt = ids[:, 1:].masked_fill(~real[:, 1:], -100)  # padding left out of the loss
        with torch.autocast("cuda", dtype=torch.bfloat16):
            mem = model.encode(imgs, slot, B, maxn)
            logits = model(ids[:, :-1], mem, mask)
            loss = F.cross_entropy(logits.float().view(-1, V), tgt.reshape(-1), ignore_index=-100)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del imgs, slot, mask, ids, lens, real, tgt, mem, logits, loss
        if i % 5 == 4:
            beam_search()

    iters, secs = ct.loop(step, target_events=110000, max_iters=1000, time_limit=60)
    return dict(iterations=iters, loop_s=round(secs, 2), drawn_res_batch_len=drawn[:30], **stats,
                model="captioning VLM: ViT-style encoder (patch 16, 8 blocks, d 768, 12 heads, position embedding resized to the grid) over 1..4 images a sample, 2-layer GELU projector 768 -> 1024, GPT-style decoder (6 blocks, d 1024, 16 heads, causal self-attention + masked cross-attention to the image tokens, 4x GELU MLP, vocab 32000 tied), random init",
                precision="fp32 weights, bf16 autocast", optimizer="AdamW", checkpointing="torch.utils.checkpoint (non-reentrant) on decoder blocks 0, 2, 4",
                data="each step a resolution from 224/288/336/384, 7840 // (196..576 patches an image) = 40..13 samples, 1..4 random images a sample, a caption length from 8..96 with real lengths of half to all of it",
                decoding="every 5th step after training: beam search, 4 beams, up to 40 new tokens, 8..2 samples at a resolution of its own, self-attention key/value cache grown by torch.cat and reordered by index_select every step, cross-attention keys and values computed once on the beam-repeated image tokens, under no_grad")


try:
    extra = run()
except Exception as e:  # keep the partial (still real) trace
    import traceback; traceback.print_exc()
    extra = dict(error=repr(e)[:500])
extra["record_mode"] = MODE
ct.finish("vlm_caption_beam_train_bf16", sys.argv[1], extra)
