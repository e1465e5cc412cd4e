import sys, time, torch
from torch.profiler import ProfilerActivity, profile
from nanovllm import LLM, SamplingParams
from nanovllm.bench import offload as b5

shape = b5.model_shape("llama-3.1-8b", {})
for skip in map(int, sys.argv[1:]):
    policy = f"quest:token_budget=2048,skip_layers={skip}"
    prompt_len, options = b5._plan(shape, 131072, 1, 40, True, {"sparse_policy": policy})
    llm = LLM("llama-3.1-8b", **options)
    prompts = b5._prompts(1, prompt_len, shape.vocab_size)
    t = time.perf_counter()
    seq = llm.add_request(prompts[0], SamplingParams(temperature=0, ignore_eos=True, max_tokens=llm.max_model_len))
    while llm.scheduler.waiting or seq.num_computed_tokens < seq.num_tokens - 1:
        llm.step()
    torch.cuda.synchronize(); print(f"skip={skip} prefill {time.perf_counter()-t:.1f}s", flush=True)
    for _ in range(3):
        llm.step()
    torch.cuda.synchronize()
    for trial in range(2):
        t = time.perf_counter()
        for _ in range(5):
            llm.step()
        torch.cuda.synchronize(); print(f"skip={skip} step {(time.perf_counter()-t)/5*1000:.1f} ms", flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            llm.step()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    print(ka.table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60))
    print(ka.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))
    prof.export_chrome_trace(f"{__import__('os').environ.get('OUT','.')}/trace_skip{skip}.json")
    del llm; b5._free()
