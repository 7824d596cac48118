# An encoder-decoder (T5-base config, random init) trained with dynamic padding: every batch has
# its own size (4..48), source length (32..512) and target length (8..256), bf16 autocast, AdamW,
# gradient accumulation over 2 micro-batches.
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import common_torch as ct
MODE = ct.start_recording()


def run():
    import random
    from transformers import T5Config, T5ForConditionalGeneration
    torch.manual_seed(0)
    random.seed(0)
    cfg = T5Config(
        vocab_size=32128, d_model=768, d_kv=64, d_ff=3072, num_layers=12, num_decoder_layers=12,
        num_heads=12, dropout_rate=0.1, decoder_start_token_id=0, pad_token_id=0)
    model = T5ForConditionalGeneration(cfg).cuda().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(i):
        for _ in range(2):
            B = random.randint(4, 48)
            S = random.randint(32, 512)
            T = random.randint(8, 256)
            src = torch.randint(1, 32128, (B, S), device="cuda")
            mask = torch.ones(B, S, dtype=torch.long, device="cuda")
            for b in range(B):
                mask[b, random.randint(S // 2, S):] = 0
            tgt = torch.randint(1, 32128, (B, T), device="cuda")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=src, attention_mask=mask, labels=tgt).loss / 2
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    iters, secs = ct.loop(step, target_events=100000, max_iters=400, time_limit=70)
    return dict(iterations=iters, loop_s=round(secs, 2),
                model="T5-base config (12+12 layers, d_model 768), random init",
                batch="4..48 x source 32..512 x target 8..256, dynamic padding, 2 micro-batches per step",
                precision="fp32 weights, bf16 autocast", optimizer="AdamW")


try:
    extra = run()
except Exception as e:  # keep the partial (still real) trace
    import traceback; traceback.print_exc()
    extra = dict(error=repr(e)[:500])
extra["record_mode"] = MODE
ct.finish("t5_seq2seq_dynpad_bf16", sys.argv[1], extra)
