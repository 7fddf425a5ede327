"""One engine as a long-lived process for bench/peers.py, run by that engine's own venv python (spyglass: the project's
.venv; vLLM and llama.cpp: their venvs under .cache/peers/). Standard library only at module level: each venv has its
own packages.

    <venv>/bin/python bench/peer_worker.py '<config JSON>'

The config names the engine (`spyglass`, `vllm` or `llamacpp`), the model (an HF directory, or a GGUF file for
llama.cpp), the methods this process serves, the thread count, the context capacity and the EOS ids. The worker
loads once, answers `{"ready": true, ...}`, then reads one JSON request per line on stdin and answers one JSON line:

    {"cmd": "generate", "method": M, "prompt_ids": [...], "max_new_tokens": N, "ignore_eos": false}
      -> {"ok": true, "output_ids": [...], "ttft_s": T, "decode_s": D, "tok_s": (n - 1) / D, ...}
    {"cmd": "probe", "bytes": B}      (spyglass only: memory read bandwidth and fp32 matmul peak, with torch)
    {"cmd": "quit"}

Time to first token runs from handing the prompt to the engine to the first generated token being known; decode
speed is (new tokens - 1) / (time from the first token to the last), the same definition for every engine. Greedy,
fp32 weights, batch 1, no prefix cache shared between requests. The protocol goes over a private copy of stdout: the
engines' own logging (vLLM logs to stdout) is sent to stderr.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any


class Worker:
    """An engine and its methods; `generate` returns output ids and the two timings."""

    info: dict[str, Any]

    def generate(self, method: str, prompt_ids: list[int], max_new_tokens: int, ignore_eos: bool) -> dict[str, Any]:
        raise NotImplementedError

    def probe(self, nbytes: int) -> dict[str, Any]:
        raise ValueError(f"{type(self).__name__} has no probe (the spyglass worker measures the machine)")


def _timings(t0: float, t_first: float | None, t_end: float, n: int) -> dict[str, Any]:
    decode_s = t_end - t_first if t_first is not None else 0.0
    return {
        "ttft_s": (t_first - t0) if t_first is not None else None,
        "decode_s": decode_s,
        "tok_s": (n - 1) / decode_s if n > 1 and decode_s > 0 else None,
        "new_tokens": n,
    }


# --- spyglass -------------------------------------------------------------------------------------------------
class SpyglassWorker(Worker):
    def __init__(self, cfg: dict[str, Any]) -> None:
        import torch

        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        sys.path.insert(0, root)
        from spyglass.drafters import build_drafter
        from spyglass.engine import EngineConfig, SpecEngine
        from spyglass.models.llama import load_transformer
        from spyglass.sampling import SamplingParams

        torch.set_num_threads(cfg["threads"])
        self.torch = torch
        self.build_drafter, self.EngineConfig, self.SpecEngine = build_drafter, EngineConfig, SpecEngine
        self.SamplingParams = SamplingParams
        self.methods = cfg["methods"]
        self.max_context = cfg["max_context"]
        dtype = cfg.get("dtype", "float32")
        self.target = load_transformer(
            cfg["model"], dtype=getattr(torch, dtype), linear_backend=cfg.get("linear_backend", "auto")
        )
        self.info = {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "linear_backend": self.target.linear_backend,
            "prefill_chunk": EngineConfig().prefill_chunk,
            "dtype": dtype,
            "kv_dtype": dtype,
        }

    def generate(self, method: str, prompt_ids: list[int], max_new_tokens: int, ignore_eos: bool) -> dict[str, Any]:
        # A fresh drafter and engine per request, as the project's drafting benches build them: no state (the suffix
        # index included) carries from one request to the next. The verify-cost curve is measured once per process.
        drafter = self.build_drafter(method, self.target, max_batch=1, max_context=self.max_context)
        controller = "measure" if drafter is not None else "off"
        config = self.EngineConfig(max_batch=1, max_context=self.max_context, controller=controller)
        engine = self.SpecEngine(self.target, drafter, config)
        params = self.SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos)
        (seq,) = engine.run([prompt_ids], params)
        st = seq.stats.summary(seq.num_generated)
        n = seq.num_generated
        return {
            "output_ids": seq.output_ids,
            "ttft_s": st["ttft_s"],
            "decode_s": st["decode_time_s"],
            "tok_s": (n - 1) / st["decode_time_s"] if n > 1 and st["decode_time_s"] > 0 else None,
            "new_tokens": n,
            "steps": st["steps"],
            "tau": st["tau"],
        }

    def probe(self, nbytes: int) -> dict[str, Any]:
        """This machine's memory read bandwidth (a sum over a float32 tensor of `nbytes`, far larger than the
        caches) and fp32 matmul peak (square products through ATen's matmul and through oneDNN's inner product, the
        prefill linears' kernel, which runs ~25% faster on Zen 4: the faster counts), both with this process's
        threads; medians of repeats."""
        torch = self.torch
        x = torch.ones(nbytes // 4, dtype=torch.float32)
        x.sum()  # pages touched, threads up
        reads = []
        for _ in range(9):
            t0 = time.perf_counter()
            x.sum()
            reads.append(time.perf_counter() - t0)
        del x
        flops = {}
        products = {"matmul": lambda a, b: a @ b}
        if torch.backends.mkldnn.is_available():
            products["onednn"] = lambda a, b: torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")
        for n in (1024, 2048):
            a, b = torch.randn(n, n), torch.randn(n, n)
            for name, product in products.items():
                product(a, b)
                samples = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    product(a, b)
                    samples.append(time.perf_counter() - t0)
                flops[f"{name}_{n}"] = 2 * n**3 / sorted(samples)[len(samples) // 2]
        reads.sort()
        return {
            "read_bytes": nbytes,
            "read_s_median": reads[len(reads) // 2],
            "read_bandwidth_gbs": nbytes / reads[len(reads) // 2] / 1e9,
            "read_bandwidth_gbs_best": nbytes / reads[0] / 1e9,
            "matmul_gflops": {k: f / 1e9 for k, f in flops.items()},
            "matmul_peak_gflops": max(flops.values()) / 1e9,
            "threads": torch.get_num_threads(),
        }


# --- vLLM -----------------------------------------------------------------------------------------------------
class VllmWorker(Worker):
    """One `LLM` per process (one method each: plain, ngram or suffix); its engine core is a child process."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        import vllm
        from vllm import LLM, SamplingParams

        (self.method,) = cfg["methods"]
        spec = cfg.get("speculative_config")
        self.SamplingParams = SamplingParams
        self.llm = LLM(
            model=cfg["model"],
            dtype=cfg.get("dtype", "float32"),
            max_model_len=cfg["max_context"],
            enable_prefix_caching=False,  # every request prefills its whole prompt, as in the other engines
            seed=0,
            speculative_config=spec,
            **cfg.get("llm_kwargs", {}),
        )
        self.engine = self.llm.llm_engine
        self._next = 0
        vc = self.engine.vllm_config
        self.info = {
            "vllm": vllm.__version__,
            "speculative_config": spec,
            "dtype": str(vc.model_config.dtype).removeprefix("torch."),
            "max_num_batched_tokens": getattr(vc.scheduler_config, "max_num_batched_tokens", None),
            "chunked_prefill": getattr(vc.scheduler_config, "enable_chunked_prefill", None),
            "compilation_mode": str(
                getattr(vc.compilation_config, "mode", getattr(vc.compilation_config, "level", ""))
            ),
            "kv_dtype": str(getattr(vc.cache_config, "cache_dtype", "auto")),
            "env": {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "OMP_", "KMP_", "LD_PRELOAD"))},
        }

    def generate(self, method: str, prompt_ids: list[int], max_new_tokens: int, ignore_eos: bool) -> dict[str, Any]:
        if method != self.method:
            raise ValueError(f"this vLLM process serves {self.method!r}, not {method!r}")
        params = self.SamplingParams(
            temperature=0.0, max_tokens=max_new_tokens, ignore_eos=ignore_eos, detokenize=False, seed=0
        )
        rid = f"r{self._next}"
        self._next += 1
        out: list[int] = []
        t0 = time.perf_counter()
        self.engine.add_request(rid, {"prompt_token_ids": list(prompt_ids)}, params)
        t_first = None
        while self.engine.has_unfinished_requests():
            for o in self.engine.step():
                if o.request_id != rid:
                    continue
                out = list(o.outputs[0].token_ids)
                if out and t_first is None:
                    t_first = time.perf_counter()
        t_end = time.perf_counter()
        return {"output_ids": out, **_timings(t0, t_first, t_end, len(out))}


# --- llama.cpp ------------------------------------------------------------------------------------------------
class LlamaCppWorker(Worker):
    """llama-cpp-python on an F32 GGUF: `plain`, and `pld` (its Python prompt lookup, which needs logits for every
    position, `logits_all=True`, on prompts longer than n_batch)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.models = {}
        common = {
            "model_path": cfg["model"],
            "n_ctx": cfg["max_context"],
            "n_threads": cfg["threads"],
            "n_threads_batch": cfg["threads"],
            "n_batch": cfg.get("n_batch", 512),
            "verbose": False,
            "seed": 0,
        }
        pld = cfg.get("pld", {})
        for method in cfg["methods"]:
            if method == "plain":
                self.models[method] = llama_cpp.Llama(**common)
            elif method == "pld":
                self.models[method] = llama_cpp.Llama(
                    **common,
                    logits_all=True,
                    draft_model=LlamaPromptLookupDecoding(
                        max_ngram_size=pld.get("max_ngram_size", 2), num_pred_tokens=pld.get("num_pred_tokens", 10)
                    ),
                )
            else:
                raise ValueError(f"llama.cpp methods are plain and pld, not {method!r}")
        self.info = {
            "llama_cpp_python": llama_cpp.__version__,
            "n_batch": common["n_batch"],
            "pld": {"max_ngram_size": pld.get("max_ngram_size", 2), "num_pred_tokens": pld.get("num_pred_tokens", 10)},
            "kv_dtype": "float16",  # llama.cpp's default KV cache type
            "env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GGML_"))},
        }

    def generate(self, method: str, prompt_ids: list[int], max_new_tokens: int, ignore_eos: bool) -> dict[str, Any]:
        if method not in self.models:
            raise ValueError(f"this llama.cpp process serves {sorted(self.models)}, not {method!r}")
        llm = self.models[method]
        eos = {llm.token_eos()}
        llm.reset()  # no prefix reuse from the previous request: the whole prompt is evaluated
        out: list[int] = []
        t_first = None
        t0 = time.perf_counter()
        gen = llm.generate(list(prompt_ids), temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True)
        for tok in gen:
            if t_first is None:
                t_first = time.perf_counter()
            out.append(int(tok))
            if len(out) >= max_new_tokens or (not ignore_eos and tok in eos):
                break
        gen.close()
        t_end = time.perf_counter()
        return {"output_ids": out, **_timings(t0, t_first, t_end, len(out))}


ENGINES = {"spyglass": SpyglassWorker, "vllm": VllmWorker, "llamacpp": LlamaCppWorker}


def serve(cfg: dict[str, Any]) -> None:
    proto = os.fdopen(os.dup(1), "w", buffering=1)  # the protocol's own stdout
    os.dup2(2, 1)  # everything else printed to stdout (engine logs) goes to stderr
    sys.stdout = sys.stderr

    def answer(obj: dict[str, Any]) -> None:
        proto.write(json.dumps(obj) + "\n")

    if cfg.get("engine") not in ENGINES:
        answer({"ready": False, "error": f"unknown engine {cfg.get('engine')!r} (one of {sorted(ENGINES)})"})
        return
    t0 = time.perf_counter()
    try:
        worker = ENGINES[cfg["engine"]](cfg)
    except Exception as e:  # noqa: BLE001 - reported to the orchestrator, which says what failed
        traceback.print_exc()
        answer({"ready": False, "error": f"{type(e).__name__}: {e}"})
        return
    answer({"ready": True, "load_s": time.perf_counter() - t0, "pid": os.getpid(), "info": worker.info})
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            cmd = req.get("cmd")
            if cmd == "quit":
                answer({"ok": True})
                break
            if cmd == "generate":
                res = worker.generate(
                    req["method"], req["prompt_ids"], int(req["max_new_tokens"]), bool(req.get("ignore_eos"))
                )
            elif cmd == "probe":
                res = worker.probe(int(req.get("bytes", 1 << 30)))
            else:
                raise ValueError(f"unknown command {cmd!r} (generate, probe or quit)")
            answer({"ok": True, **res})
        except Exception as e:  # noqa: BLE001 - one bad request is answered, the worker stays up
            traceback.print_exc()
            answer({"ok": False, "error": f"{type(e).__name__}: {e}"})


if __name__ == "__main__":  # vLLM's engine core is started by multiprocessing: LLM(...) only under this guard
    if len(sys.argv) != 2:
        sys.exit("usage: peer_worker.py '<config JSON>'")
    serve(json.loads(sys.argv[1]))
