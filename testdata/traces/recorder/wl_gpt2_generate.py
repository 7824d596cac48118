# A text-generation service: GPT-2 small (fp16) answers requests of a random batch size, prompt
# length and answer length with a growing key/value cache (transformers' generate, greedy).
import os, random, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import common_torch as ct
MODE = ct.start_recording()


def run():
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12)
    model = GPT2LMHeadModel(cfg).half().cuda().eval()
    rng = random.Random(5)
    reqs = []

    def step(i):
        B = rng.choice([1, 2, 4, 8, 16, 32])
        P = rng.randint(16, 512)
        N = rng.randint(8, 64)
        reqs.append((B, P, N))
        ids = torch.randint(0, cfg.vocab_size, (B, P), device="cuda")
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=N,
                                 min_new_tokens=N, do_sample=False, pad_token_id=0, use_cache=True)
        out.cpu()

    iters, secs = ct.loop(step, target_events=200000, max_iters=400, time_limit=60)
    return dict(iterations=iters, loop_s=round(secs, 2), model="GPT-2 small config (124M), random init, fp16, eval",
                requests="batch in {1,2,4,8,16,32}, prompt 16..512 tokens, 8..64 new tokens, greedy, KV cache",
                first_requests=reqs[:10], transformers=transformers.__version__)


try:
    extra = run()
except Exception as e:
    import traceback; traceback.print_exc()
    extra = dict(error=repr(e)[:500])
extra["record_mode"] = MODE
ct.finish("gpt2_generate_varbatch_fp16", sys.argv[1], extra)
