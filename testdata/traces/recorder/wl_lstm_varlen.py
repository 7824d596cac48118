# A speech-style sequence model: a 3-layer bidirectional LSTM (cuDNN) over packed batches of
# variable-length sequences (batch 8..96, 50..1500 frames, 80 features), CTC loss, Adam. cuDNN's
# RNN workspace and reserve space change size with every batch's total length.
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import common_torch as ct
MODE = ct.start_recording()


def run():
    import random
    import torch.nn as nn
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
    torch.manual_seed(0)
    random.seed(0)
    lstm = nn.LSTM(80, 512, num_layers=3, bidirectional=True, batch_first=True).cuda()
    head = nn.Linear(1024, 32).cuda()
    opt = torch.optim.Adam(list(lstm.parameters()) + list(head.parameters()), lr=1e-4)
    ctc = nn.CTCLoss(blank=0, zero_infinity=True)

    def step(i):
        B = random.randint(8, 96)
        T = random.randint(50, 1500)
        lens = sorted((random.randint(max(10, T // 4), T) for _ in range(B)), reverse=True)
        lens[0] = T
        x = torch.randn(B, T, 80, device="cuda")
        packed = pack_padded_sequence(x, torch.tensor(lens), batch_first=True)
        out, _ = lstm(packed)
        out, olens = pad_packed_sequence(out, batch_first=True)
        logp = head(out).log_softmax(-1).transpose(0, 1)
        tl = torch.tensor([random.randint(1, max(1, l // 4)) for l in lens])
        tgt = torch.randint(1, 32, (int(tl.sum()),), device="cuda")
        loss = ctc(logp, tgt, olens, tl)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    iters, secs = ct.loop(step, target_events=100000, max_iters=1500, time_limit=70)
    return dict(iterations=iters, loop_s=round(secs, 2),
                model="3-layer bidirectional LSTM 80 -> 512 (cuDNN), linear head to 32 classes, CTC loss",
                batch="8..96 sequences of up to 50..1500 frames, packed", precision="fp32", optimizer="Adam")


try:
    extra = run()
except Exception as e:  # keep the partial (still real) trace
    import traceback; traceback.print_exc()
    extra = dict(error=repr(e)[:500])
extra["record_mode"] = MODE
ct.finish("lstm_ctc_varlen_fp32", sys.argv[1], extra)
