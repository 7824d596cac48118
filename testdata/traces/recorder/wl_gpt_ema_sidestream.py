# A GPT-style language model trained on the default stream while a side stream, from the same
# thread, prepares the next batch (random token ids of a length drawn every step, padded and
# masked), keeps an exponential moving average of the weights after every optimizer step, and
# every third step evaluates the averaged model on a batch of its own length; tensors cross
# streams with events and record_stream. bf16 autocast, AdamW, gradients accumulated over 1..3
# micro-batches drawn every step.
import os, random, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import common_torch as ct
MODE = ct.start_recording()


def run():
    import copy
    import torch.nn as nn
    import torch.nn.functional as F
    torch.manual_seed(5)
    rng = random.Random(5)
    D, H, L, V = 768, 12, 8, 32000

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.n1, self.n2 = nn.LayerNorm(D), nn.LayerNorm(D)
            self.qkv, self.o = nn.Linear(D, 3 * D), nn.Linear(D, D)
            self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

        def forward(self, x):
            B, N, _ = x.shape
            q, k, v = self.qkv(self.n1(x)).view(B, N, 3, H, D // H).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.o(a.transpose(1, 2).reshape(B, N, D))
            return x + self.mlp(self.n2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.pos = nn.Embedding(V, D), nn.Embedding(1024, D)
            self.blocks = nn.ModuleList(Block() for _ in range(L))
            self.norm = nn.LayerNorm(D)

        def forward(self, ids):
            x = self.emb(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
            for b in self.blocks:
                x = b(x)
            return F.linear(self.norm(x), self.emb.weight)

    model = GPT().cuda()
    ema = copy.deepcopy(model).eval()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    side = torch.cuda.Stream()
    main = torch.cuda.current_stream()

    def batch():
        n = rng.choice([128, 192, 256, 384, 512, 768, 1024])
        b = max(1, 16384 // n)
        with torch.cuda.stream(side):
            ids = torch.randint(0, V, (b, n + 1), device="cuda")
            lens = torch.randint(n // 2, n + 1, (b,), device="cuda")
            mask = torch.arange(n + 1, device="cuda")[None, :] < lens[:, None]
            tgt = ids[:, 1:].masked_fill(~mask[:, 1:], -100)
            ready = torch.cuda.Event()
            ready.record(side)
        return ids[:, :-1], tgt, ready

    nxt = [batch()]

    def step(i):
        micro = rng.randint(1, 3)
        for _ in range(micro):
            ids, tgt, ready = nxt.pop()
            main.wait_event(ready)
            ids.record_stream(main)
            tgt.record_stream(main)
            nxt.append(batch())  # the side stream prepares the next one meanwhile
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(ids).float().view(-1, V), tgt.reshape(-1), ignore_index=-100) / micro
            loss.backward()
            del ids, tgt, loss
        opt.step()
        opt.zero_grad(set_to_none=True)
        done = torch.cuda.Event()
        done.record(main)
        side.wait_event(done)
        with torch.cuda.stream(side), torch.no_grad():
            for pe, pm in zip(ema.parameters(), model.parameters()):
                pe.lerp_(pm, 0.01)
            if i % 3 == 2:
                n = rng.choice([256, 512, 1024])
                ids = torch.randint(0, V, (max(1, 8192 // n), n), device="cuda")
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    out = ema(ids).float().log_softmax(-1).amax(-1).mean()
                del ids, out
        main.wait_stream(side)  # the next step's weights change after the average read them

    iters, secs = ct.loop(step, target_events=110000, max_iters=3000, time_limit=60)
    return dict(iterations=iters, loop_s=round(secs, 2),
                model="GPT-style decoder, 8 layers, d 768, 12 heads, vocab 32000 (tied), random init; EMA copy updated on a side stream",
                data="16k tokens a micro-batch at a length drawn from 128..1024, padded and masked on the side stream; 1..3 micro-batches a step; evaluation of the EMA model every third step")


try:
    extra = run()
except Exception as e:
    import traceback; traceback.print_exc()
    extra = dict(error=repr(e)[:500])
extra["record_mode"] = MODE
ct.finish("gpt_ema_sidestream_train_bf16", sys.argv[1], extra)
