# A recommendation model shaped like DLRM: eight embedding tables (20,000-200,000 rows of 64)
# looked up as bags of random size (EmbeddingBag, 1-40 ids a bag), a bottom MLP over dense
# features, pairwise feature interactions and a top MLP; trained with sparse gradients (SparseAdam
# for the tables, Adam for the MLPs) at a batch that changes every step (256-4096). fp32.
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import common_torch as ct
MODE = ct.start_recording()


def run():
    import random
    import torch.nn as nn
    import torch.nn.functional as F
    torch.manual_seed(4)
    random.seed(4)
    D, ROWS = 64, [200000, 150000, 100000, 80000, 50000, 40000, 30000, 20000]

    class DLRM(nn.Module):
        def __init__(self):
            super().__init__()
            self.tables = nn.ModuleList(nn.EmbeddingBag(r, D, mode="sum", sparse=True) for r in ROWS)
            self.bottom = nn.Sequential(nn.Linear(13, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, D), nn.ReLU())
            n = len(ROWS) + 1
            self.top = nn.Sequential(nn.Linear(D + n * (n - 1) // 2, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 1))

        def forward(self, dense, bags):
            feats = [self.bottom(dense)] + [t(ids, offs) for t, (ids, offs) in zip(self.tables, bags)]
            z = torch.stack(feats, 1)
            inter = torch.bmm(z, z.transpose(1, 2))
            i, j = torch.triu_indices(z.shape[1], z.shape[1], 1, device=z.device)
            return self.top(torch.cat([feats[0], inter[:, i, j]], 1)).squeeze(1)

    net = DLRM().cuda()
    sparse = list(net.tables.parameters())
    dense_params = [p for n, p in net.named_parameters() if not n.startswith("tables.")]
    opt_s, opt_d = torch.optim.SparseAdam(sparse, lr=1e-3), torch.optim.Adam(dense_params, lr=1e-3)

    def step(i):
        b = random.choice([256, 512, 1024, 2048, 4096])
        bags = []
        for r in ROWS:
            lens = torch.randint(1, 41, (b,), device="cuda")
            offs = torch.cat([torch.zeros(1, dtype=torch.long, device="cuda"), lens.cumsum(0)[:-1]])
            ids = torch.randint(0, r, (int(lens.sum()),), device="cuda")
            bags.append((ids, offs))
        dense = torch.randn(b, 13, device="cuda")
        y = torch.randint(0, 2, (b,), device="cuda").float()
        loss = F.binary_cross_entropy_with_logits(net(dense, bags), y)
        loss.backward()
        opt_s.step()
        opt_d.step()
        opt_s.zero_grad(set_to_none=True)
        opt_d.zero_grad(set_to_none=True)

    iters, secs = ct.loop(step, target_events=100000, max_iters=5000, time_limit=90)
    return dict(iterations=iters, loop_s=round(secs, 2), model="DLRM-style: 8 EmbeddingBag tables (20k-200k x 64), bottom and top MLPs, random init",
                precision="fp32", data="batch 256-4096, bags of 1-40 ids", optimizer="SparseAdam + Adam")


try:
    extra = run()
except Exception as e:  # keep the partial (still real) trace
    import traceback; traceback.print_exc()
    extra = dict(error=repr(e)[:500])
extra["record_mode"] = MODE
ct.finish("dlrm_sparse_train_varbatch_fp32", sys.argv[1], extra)
