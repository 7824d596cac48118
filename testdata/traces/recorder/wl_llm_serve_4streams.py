# A decoder-only language-model service on four CUDA streams from one thread: each stream serves
# one request at a time (batch 1..8, prompt 32..1024 tokens, 4..40 new tokens); a request's
# key/value cache is allocated once at prompt + max-new length and lives until the request ends,
# while every decode step makes small short-lived blocks. The thread steps the four requests in
# turn, one token each, so long-lived caches of different sizes and lifetimes interleave with
# per-token scratch on four streams. Finished tokens go to the host without blocking; a request's
# memory is freed after its stream's last event. fp16, no autograd.
import os, random, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import common_torch as ct
MODE = ct.start_recording()


def run():
    import torch.nn as nn
    import torch.nn.functional as F
    torch.manual_seed(4)
    rng = random.Random(4)
    D, H, L, V, NS = 1024, 16, 6, 32000, 4
    HD = D // H

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.n1, self.n2 = nn.LayerNorm(D), nn.LayerNorm(D)
            self.qkv, self.o = nn.Linear(D, 3 * D), nn.Linear(D, D)
            self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

        def forward(self, x, kc, vc, pos):
            B, N, _ = x.shape
            q, k, v = self.qkv(self.n1(x)).view(B, N, 3, H, HD).permute(2, 0, 3, 1, 4)
            kc[:, :, pos:pos + N] = k
            vc[:, :, pos:pos + N] = v
            a = F.scaled_dot_product_attention(q, kc[:, :, :pos + N], vc[:, :, :pos + N], is_causal=(N > 1))
            x = x + self.o(a.transpose(1, 2).reshape(B, N, D))
            return x + self.down(F.gelu(self.up(self.n2(x))))

    emb = nn.Embedding(V, D).cuda().half()
    layers = nn.ModuleList(Layer() for _ in range(L)).cuda().half().eval()
    head = nn.Linear(D, V, bias=False).cuda().half()
    streams = [torch.cuda.Stream() for _ in range(NS)]
    slots = [None] * NS
    done = []
    served = [0]

    def start(s):
        B = rng.randint(1, 8)
        P = rng.choice([32, 64, 96, 128, 192, 256, 384, 512, 768, 1024])
        new = rng.randint(4, 40)
        with torch.cuda.stream(streams[s]):
            ids = torch.randint(0, V, (B, P), device="cuda")
            caches = [(torch.empty(B, H, P + new, HD, device="cuda", dtype=torch.half),
                       torch.empty(B, H, P + new, HD, device="cuda", dtype=torch.half)) for _ in range(L)]
            out = torch.empty(B, new, dtype=torch.long, device="cuda")
        served[0] += 1
        slots[s] = dict(ids=ids, caches=caches, out=out, pos=0, n=0, new=new)

    @torch.no_grad()
    def advance(s):
        r = slots[s]
        with torch.cuda.stream(streams[s]):
            x = emb(r["ids"])
            for l, (kc, vc) in zip(layers, r["caches"]):
                x = l(x, kc, vc, r["pos"])
            logits = head(x[:, -1]).float()
            probs = torch.softmax(logits / 0.8, -1)
            top = torch.topk(probs, 50)
            pick = torch.multinomial(top.values, 1)
            nxt = top.indices.gather(1, pick)
            r["out"][:, r["n"]] = nxt[:, 0]
            r["pos"] += r["ids"].shape[1]
            r["ids"] = nxt
            r["n"] += 1
            if r["n"] == r["new"]:
                host = r["out"].to("cpu", non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(streams[s])
                done.append((ev, host))
                slots[s] = None  # the request's caches and output are freed here
        while len(done) > 8:
            done.pop(0)[0].synchronize()

    def step(i):
        # one round: a new request where a stream is idle, then one token on every stream
        for s in range(NS):
            if slots[s] is None:
                start(s)
        for s in range(NS):
            advance(s)

    iters, secs = ct.loop(step, target_events=110000, max_iters=20000, time_limit=60)
    for ev, _ in done:
        ev.synchronize()
    slots[:] = [None] * NS
    return dict(iterations=iters, loop_s=round(secs, 2), requests=served[0],
                model="decoder-only transformer, 6 layers, d 1024, 16 heads, vocab 32000, random init, fp16",
                service="4 streams from one thread, one request per stream at a time, batch 1..8, prompt 32..1024, 4..40 new tokens, top-50 sampling, KV cache allocated at prompt + max-new length")


try:
    extra = run()
except Exception as e:
    import traceback; traceback.print_exc()
    extra = dict(error=repr(e)[:500])
extra["record_mode"] = MODE
ct.finish("llm_serve_4streams_kvcache_fp16", sys.argv[1], extra)
