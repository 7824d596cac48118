# A speech-recognition-shaped encoder-decoder served one request at a time: a convolutional
# front end over log-mel frames of random length (1-30 s), a transformer encoder, then greedy
# decoding of a random number of tokens whose key/value cache grows by concatenation at every
# step (so each step asks for a slightly larger block). fp16 inference, no autograd.
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import common_torch as ct
MODE = ct.start_recording()


def run():
    import random
    import torch.nn as nn
    import torch.nn.functional as F
    torch.manual_seed(2)
    random.seed(2)
    D, H, LE, LD, V = 768, 12, 6, 4, 8000

    def attn(q, k, v):
        B, N, _ = q.shape
        sh = lambda z: z.view(B, z.shape[1], H, D // H).transpose(1, 2)
        return F.scaled_dot_product_attention(sh(q), sh(k), sh(v)).transpose(1, 2).reshape(B, N, D)

    class Enc(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.c2 = nn.Conv1d(80, D, 3, padding=1), nn.Conv1d(D, D, 3, stride=2, padding=1)
            self.layers = nn.ModuleList(nn.TransformerEncoderLayer(D, H, 4 * D, batch_first=True, norm_first=True) for _ in range(LE))

        def forward(self, mel):
            h = F.gelu(self.c2(F.gelu(self.c1(mel)))).transpose(1, 2)
            for l in self.layers:
                h = l(h)
            return h

    class DecLayer(nn.Module):
        def __init__(self):
            super().__init__()
            self.n1, self.n2, self.n3 = nn.LayerNorm(D), nn.LayerNorm(D), nn.LayerNorm(D)
            self.q, self.kv, self.o = nn.Linear(D, D), nn.Linear(D, 2 * D), nn.Linear(D, D)
            self.cq, self.ckv, self.co = nn.Linear(D, D), nn.Linear(D, 2 * D), nn.Linear(D, D)
            self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

        def forward(self, x, cache, mem_kv):
            h = self.n1(x)
            k, v = self.kv(h).chunk(2, -1)
            if cache is not None:
                k, v = torch.cat([cache[0], k], 1), torch.cat([cache[1], v], 1)
            x = x + self.o(attn(self.q(h), k, v))
            x = x + self.co(attn(self.cq(self.n2(x)), *mem_kv))
            return x + self.mlp(self.n3(x)), (k, v)

    enc = Enc().cuda().half().eval()
    dec = nn.ModuleList(DecLayer() for _ in range(LD)).cuda().half().eval()
    emb, head = nn.Embedding(V, D).cuda().half(), nn.Linear(D, V).cuda().half()

    @torch.no_grad()
    def step(i):
        frames = random.randint(100, 3000)  # 10 ms frames
        mem = enc(torch.randn(1, 80, frames, device="cuda", dtype=torch.half))
        mem_kv = [l.ckv(mem).chunk(2, -1) for l in dec]
        tok = torch.zeros(1, 1, dtype=torch.long, device="cuda")
        caches = [None] * LD
        for _ in range(random.randint(5, 120)):
            x = emb(tok)
            for j, l in enumerate(dec):
                x, caches[j] = l(x, caches[j], mem_kv[j])
            tok = head(x[:, -1:]).argmax(-1)

    iters, secs = ct.loop(step, target_events=100000, max_iters=2000, time_limit=60)
    return dict(iterations=iters, loop_s=round(secs, 2), model="conv front end + 6-layer encoder + 4-layer decoder, d=768, random init",
                precision="fp16 inference", decoding="greedy, 5-120 tokens, key/value cache grown by torch.cat")


try:
    extra = run()
except Exception as e:  # keep the partial (still real) trace
    import traceback; traceback.print_exc()
    extra = dict(error=repr(e)[:500])
extra["record_mode"] = MODE
ct.finish("speech_encdec_greedy_varlen_fp16", sys.argv[1], extra)
