# A graph network (4 message-passing layers, hidden 256) trained on random graphs of changing
# size (10k..150k nodes, 4..12 edges per node): gathers, scatter-adds and index ops whose
# buffers follow each graph's node and edge counts; fp32, Adam.
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import common_torch as ct
MODE = ct.start_recording()


def run():
    import random
    import torch.nn as nn
    torch.manual_seed(0)
    random.seed(0)
    H = 256

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.msg = nn.Linear(2 * H, H)
            self.upd = nn.Linear(2 * H, H)

        def forward(self, x, src, dst):
            m = torch.relu(self.msg(torch.cat([x[src], x[dst]], 1)))
            agg = torch.zeros_like(x).index_add_(0, dst, m)
            deg = torch.zeros(x.shape[0], device=x.device).index_add_(0, dst, torch.ones_like(dst, dtype=x.dtype))
            agg = agg / deg.clamp(min=1).unsqueeze(1)
            return torch.relu(self.upd(torch.cat([x, agg], 1))) + x

    inp = nn.Linear(64, H).cuda()
    layers = nn.ModuleList([Layer() for _ in range(4)]).cuda()
    out = nn.Linear(H, 16).cuda()
    params = list(inp.parameters()) + list(layers.parameters()) + list(out.parameters())
    opt = torch.optim.Adam(params, lr=1e-3)

    def step(i):
        N = random.randint(10_000, 150_000)
        E = N * random.randint(4, 12)
        x = torch.randn(N, 64, device="cuda")
        src = torch.randint(0, N, (E,), device="cuda")
        dst = torch.randint(0, N, (E,), device="cuda")
        y = torch.randint(0, 16, (N,), device="cuda")
        h = inp(x)
        for l in layers:
            h = l(h, src, dst)
        loss = nn.functional.cross_entropy(out(h), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    iters, secs = ct.loop(step, target_events=100000, max_iters=2000, time_limit=70)
    return dict(iterations=iters, loop_s=round(secs, 2),
                model="4 message-passing layers (gather, linear, index_add mean aggregation), hidden 256",
                batch="one random graph a step: 10k..150k nodes, 4..12 edges per node",
                precision="fp32", optimizer="Adam")


try:
    extra = run()
except Exception as e:  # keep the partial (still real) trace
    import traceback; traceback.print_exc()
    extra = dict(error=repr(e)[:500])
extra["record_mode"] = MODE
ct.finish("gnn_mpnn_varsize_fp32", sys.argv[1], extra)
