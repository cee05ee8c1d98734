"""Serve an offloaded pipeline over HTTP: many requests, one pipeline, turns ordered by group.

    pip install -e ".[serve]"                                       # FastAPI and uvicorn
    python examples/serve.py --port 8000                            # the synthetic Wan2.2 shape
    python examples/serve.py --pipeline ./wan22-folder --order arrival    # a saved diffusers folder
    python examples/serve.py load --url http://127.0.0.1:8000 --clients 8 --requests 40
    python examples/serve.py load --url http://127.0.0.1:8000 --rate 20 --requests 40  # open loop

``POST /generate`` (``{"prompt": "a red dog", "seed": 0, "steps": 8}``) is a synchronous endpoint:
FastAPI runs each request on its thread pool, so requests run at once, each on its own thread,
their phases taking turns under the scheduler's order (``--order``: group by default).  It
answers the output's SHA-256 and shape (the same request gives the same bits, alone or among
others).  ``GET /stats`` gives the phase changes, the bytes moved and ``scheduler.waits``.

A diffusers pipeline keeps per-call state on itself (its step index, guidance scale, the noise
scheduler's timesteps), so each request gets its own pipeline object over the same offloaded
components: ``from_pipe`` with a copy of the noise scheduler, the shared VAE one request at a time
(`OneAtATime`: Wan's keeps its decode caches on itself).  The synthetic pipeline keeps none.

``load`` is a bounded load generator on loopback: ``--clients N`` is a closed loop (N clients, each
sending its next request when the last one answered), ``--rate R`` an open loop (Poisson arrivals,
R per second); it stops after ``--requests`` or ``--time-limit`` seconds, whichever comes first,
and prints throughput, p50/p99 latency and phase changes per request.
"""

# (No ``from __future__ import annotations``: FastAPI reads the request body's type from the
# endpoint's annotation, a class made inside `make_app`, which a string could not name.)
import argparse
import copy
import hashlib
import json
import logging
import math
import random
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

import torch

from residency import ConfigError, Scheduler, TurnOrder
from residency.options.order import ORDERS, as_turn_order

#: Components a served pipeline offloads (the synthetic one's encoder and both experts).
CONFIG = {"mode": "module", "components": ["dit", "text_encoder"]}


class SyntheticService:
    """The synthetic Wan2.2-shaped pipeline, offloaded; requests share the one module (its
    forward keeps no state of its own)."""

    def __init__(self, order: TurnOrder, size: str = "tiny", device: str = "cpu") -> None:
        from residency.app.synthetic import SyntheticWan22

        self.pipe = SyntheticWan22.build(size)
        self.scheduler = Scheduler.from_pipeline(self.pipe, {**CONFIG, "order": order.to_dict()},
                                                 device=device)
        self.pipe.offload = self.scheduler

    def generate(self, prompt: str, seed: int, steps: int) -> torch.Tensor:
        return self.pipe(prompt, steps=steps, seed=seed)

    def close(self) -> None:
        self.scheduler.close()


class OneAtATime:
    """A component that keeps per-call state on itself, called by one request at a time: Wan's
    VAE holds its causal convolutions' caches on the module while it decodes, so two requests
    decoding at once read each other's (measured: 4 concurrent calls of a from_pipe'd tiny Wan2.2,
    no offloading at all, all 4 outputs differ from the call alone).  Every other attribute is
    the component's own; the lock is held for its calls only.

        pipe = type(base).from_pipe(base, vae=OneAtATime(base.vae))
    """

    _CALLS = ("encode", "decode", "forward", "tiled_decode", "tiled_encode")

    def __init__(self, module: torch.nn.Module) -> None:
        vars(self).update(_module=module, _lock=threading.Lock())

    def __getattr__(self, name: str):
        value = getattr(self._module, name)
        return self._one_at_a_time(value) if name in self._CALLS else value

    def __call__(self, *args, **kwargs):
        return self._one_at_a_time(self._module)(*args, **kwargs)

    def _one_at_a_time(self, call):
        def called(*args, **kwargs):
            with self._lock:
                return call(*args, **kwargs)
        return called


class DiffusersService:
    """A saved diffusers folder, offloaded once; each request calls its own pipeline object over
    the same components (``from_pipe``), with its own copy of the noise scheduler and the VAE
    behind `OneAtATime` (the only shared component that keeps per-call state on itself)."""

    def __init__(self, folder: Path, order: TurnOrder, device: str = "cpu",
                 call_kwargs: dict | None = None) -> None:
        from diffusers import DiffusionPipeline

        from residency.adapters.diffusers import from_pretrained, offload_scheduler

        # from_pipe warns, per request, that OneAtATime is not the VAE's class (it is not meant to)
        logging.getLogger("diffusers.pipelines.pipeline_utils").setLevel(logging.ERROR)
        self.base = from_pretrained(DiffusionPipeline, folder, {**CONFIG, "order": order.to_dict()},
                                    device=device, local_files_only=True)
        self.scheduler = offload_scheduler(self.base)
        self.vae = OneAtATime(self.base.vae) if getattr(self.base, "vae", None) else None
        #: More keyword arguments for every call (height, width, num_frames, ...).
        self.call_kwargs = dict(call_kwargs or {})

    def generate(self, prompt: str, seed: int, steps: int) -> torch.Tensor:
        shared = {} if self.vae is None else {"vae": self.vae}
        pipe = type(self.base).from_pipe(self.base, scheduler=copy.deepcopy(self.base.scheduler),
                                         **shared)
        generator = torch.Generator().manual_seed(seed)
        out = pipe(prompt, num_inference_steps=steps, generator=generator, output_type="pt",
                   **self.call_kwargs)
        return next(v for v in vars(out).values() if isinstance(v, torch.Tensor))

    def close(self) -> None:
        from residency.adapters.diffusers import disable_offload

        disable_offload(self.base)


def make_app(service):
    """The FastAPI app over `service` (`SyntheticService` or `DiffusersService`)."""
    from fastapi import FastAPI
    from pydantic import BaseModel, Field

    class Request(BaseModel):
        prompt: str = "a cat on the moon"
        seed: int = 0
        steps: int = Field(8, ge=1, le=1000)

    app = FastAPI(title="residency: one offloaded pipeline, many requests")

    @app.post("/generate")
    def generate(request: Request) -> dict:  # sync: FastAPI runs it on its thread pool
        began = time.perf_counter()
        output = service.generate(request.prompt, request.seed, request.steps)
        digest = hashlib.sha256(output.detach().cpu().contiguous().view(torch.uint8)
                                .numpy().tobytes()).hexdigest()
        return {"sha256": digest, "shape": list(output.shape),
                "seconds": time.perf_counter() - began}

    @app.get("/stats")
    def stats() -> dict:
        scheduler = service.scheduler
        return {"order": scheduler.order.to_dict(), "phase_changes": scheduler.transitions.count,
                "bytes_moved": scheduler.transitions.nbytes,
                "waits": {name: vars_of(stats) for name, stats in scheduler.waits.items()}}

    return app


def vars_of(stats) -> dict:
    return {field: getattr(stats, field) for field in ("entries", "waits", "p50", "p99", "max")}


# -- the load generator --------------------------------------------------------------------------


def _post(url: str, body: dict, timeout: float) -> dict:
    request = urllib.request.Request(f"{url}/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        return json.loads(answer.read())


def _get(url: str, path: str, timeout: float = 10.0) -> dict:
    with urllib.request.urlopen(f"{url}{path}", timeout=timeout) as answer:
        return json.loads(answer.read())


def load(url: str, *, requests: int, clients: int | None = None, rate: float | None = None,
         time_limit: float = 60.0, steps: int = 8, seed: int = 0) -> dict:
    """Send at most `requests` requests within `time_limit` seconds: closed loop with `clients`,
    or open loop at `rate` per second (Poisson arrivals).  Returns the figures (and prints them
    in `main`)."""
    before = _get(url, "/stats")["phase_changes"]
    deadline = time.monotonic() + time_limit
    latencies: list[float] = []
    answers: list[dict] = []
    failures: list[str] = []
    lock = threading.Lock()
    issued = iter(range(requests))

    def one(index: int) -> None:
        body = {"prompt": f"request {index % 4}", "seed": index % 4, "steps": steps}
        began = time.monotonic()
        try:
            answer = _post(url, body, max(0.1, deadline - began))
        except OSError as error:
            with lock:
                failures.append(repr(error))
            return
        with lock:
            latencies.append(time.monotonic() - began)
            answers.append({**answer, "index": index})

    def client() -> None:
        for index in issued:  # (a shared iterator: each index goes to one client)
            if time.monotonic() >= deadline:
                return
            one(index)

    began = time.monotonic()
    if clients is not None:
        workers = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
        for worker in workers:
            worker.start()
    else:
        arrivals = random.Random(seed)
        workers = []
        for index in range(requests):
            if time.monotonic() >= deadline:
                break
            worker = threading.Thread(target=one, args=(index,), daemon=True)
            worker.start()
            workers.append(worker)
            time.sleep(arrivals.expovariate(rate))
    for worker in workers:
        worker.join(max(0.0, deadline - time.monotonic()) + 5)
    wall = time.monotonic() - began
    changes = _get(url, "/stats")["phase_changes"] - before
    done = len(latencies)
    ordered = sorted(latencies)
    return {
        "mode": f"closed loop, {clients} clients" if clients is not None
        else f"open loop, {rate}/s Poisson", "requests": done, "failed": len(failures),
        "throughput_rps": done / wall if wall else 0.0,
        "p50_s": statistics.median(ordered) if ordered else None,
        "p99_s": ordered[max(0, math.ceil(0.99 * done) - 1)] if ordered else None,
        "changes_per_request": changes / done if done else None,
        "same_request_same_bits": _consistent(answers), "failures": failures[:3],
    }


def _consistent(answers: list[dict]) -> bool:
    """Whether every request with the same prompt and seed got the same bits."""
    seen: dict[int, str] = {}
    return all(seen.setdefault(a["index"] % 4, a["sha256"]) == a["sha256"] for a in answers)


# -- the command line ------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python examples/serve.py",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    serve = sub.add_parser("serve", help="run the server (the default)")
    for target in (parser, serve):
        target.add_argument("--pipeline", type=Path, default=None,
                            help="a saved diffusers folder (default: the synthetic pipeline)")
        target.add_argument("--order", default="group",
                            help=f"order of turns: {' or '.join(ORDERS)}, or a JSON object such "
                            "as '{\"by\": \"group\", \"max_wait\": 0.25}' (default: group)")
        target.add_argument("--host", default="127.0.0.1")
        target.add_argument("--port", type=int, default=8000, help="0: any free port")
        target.add_argument("--size", default="tiny", help="synthetic pipeline size")
        target.add_argument("--call-kwargs", default="{}", help="--pipeline: more keyword "
                            "arguments for each call, as a JSON object (height, width, ...)")
    generate = sub.add_parser("load", help="the load generator")
    generate.add_argument("--url", required=True)
    generate.add_argument("--requests", type=int, default=40)
    loop = generate.add_mutually_exclusive_group()
    loop.add_argument("--clients", type=int, default=None, help="closed loop: N clients")
    loop.add_argument("--rate", type=float, default=None, help="open loop: arrivals per second")
    generate.add_argument("--time-limit", type=float, default=60.0)
    generate.add_argument("--steps", type=int, default=8)
    return parser


def _order(text: str) -> TurnOrder:
    value = json.loads(text) if text.lstrip().startswith("{") else text
    return as_turn_order(value)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "load":
        if args.requests < 1 or args.time_limit <= 0 or (args.rate is not None and args.rate <= 0):
            parser.error("--requests, --time-limit and --rate take positive numbers")
        clients = args.clients if args.clients is not None or args.rate is not None else 1
        if clients is not None and clients < 1:
            parser.error("--clients takes a positive whole number")
        figures = load(args.url.rstrip("/"), requests=args.requests, clients=clients,
                       rate=args.rate, time_limit=args.time_limit, steps=args.steps)
        print(json.dumps(figures, indent=2))
        return 0
    try:
        order = _order(args.order)
    except (ConfigError, json.JSONDecodeError) as error:
        parser.error(f"--order: {error}")
    if args.pipeline is not None and not args.pipeline.is_dir():
        parser.error(f"--pipeline {args.pipeline}: not a folder")
    try:
        call_kwargs = json.loads(args.call_kwargs)
    except json.JSONDecodeError as error:
        parser.error(f"--call-kwargs: not JSON ({error.msg})")
    if not isinstance(call_kwargs, dict):
        parser.error("--call-kwargs: give a JSON object, such as '{\"height\": 480}'")
    import uvicorn

    service = (DiffusersService(args.pipeline, order, call_kwargs=call_kwargs)
               if args.pipeline is not None else SyntheticService(order, args.size))
    uvicorn.run(make_app(service), host=args.host, port=args.port, log_level="warning")
    service.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
