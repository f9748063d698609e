"""The router deployment: the OpenAI-compatible HTTP ingress and the round coordinator.

It runs each request's lifecycle -- validate, admit, follow, stream, cancel -- on the
same scheduler the in-process engine runs: a ``SequenceDriver`` per request (committed
tokens, streaming state) and the ``RoundCoordinator`` tick loop that batches every
active request's round into one call per proposer replica and one per target replica,
here over ``ServeTransport``. It holds ObjectRefs, never tensors. Prompt lookup runs
here: it needs only the committed tokens the router already has. Response bodies and
SSE chunks are shaped in ``openai_responses.py``, stream writes grouped in ``streaming.py``,
a request's choices handled in ``choices.py``, and every request passes ``RequestGuard``
(``request_guard.py``) first.
"""
from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import os
import time
import uuid
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from ray import serve
from ray.serve.handle import DeploymentHandle

from specserve.engine.assembly import coordination, proposer_needs
from specserve.engine.errors import InvalidRequestError
from specserve.engine.grammar.compiler import grammar_compiler
from specserve.engine.grammar.spec import StructuredOutput
from specserve.engine.kv.block_ledger import AdmissionError
from specserve.engine.model.bundle import Bundle
from specserve.engine.model.chat import ChatTemplate
from specserve.engine.model.tokenizer import TextTokenizer
from specserve.engine.options import GenerationOptions
from specserve.engine.sched.background import detached
from specserve.engine.sched.coordinator import RequestFailedError, RoundCoordinator
from specserve.engine.sched.sequence_driver import DriverFactory, Speculation
from specserve.engine.speculative.sequence import TokenEvent

from .choices import admit_all, all_choices, choice_options
from .kv_manager import owned_seq_id
from .metrics import ServeRoundMetrics
from .openai_protocol import ApiError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .openai_responses import SSE_DONE, ChoiceEvent, Echo, ResponseShaper
from .readiness import CONNECT_WAIT_S, READY_WAIT_S, Readiness
from .request_guard import RequestGuard
from .settings import ServeSettings
from .streaming import WriteBudget, cancel_when_dropped, token_writes
from .tool_calls import ToolPlan, render_prompt, tool_format, tool_plan
from .transport import ServeTransport

log = logging.getLogger("specserve.router")
app = FastAPI(title="specserve", description="Lossless speculative decoding behind an OpenAI-compatible API.")


@app.middleware("http")
async def _guarded(request: Request, call_next):
    """Every request passes the replica's ``RequestGuard`` first, before any parsing. The
    replica's ``Router`` is found as Serve's class-based routes find their ``self``."""
    refusal = serve.get_replica_context().servable_object.guard.refusal(request)
    return refusal if refusal is not None else await call_next(request)


@app.exception_handler(Exception)
async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s", request.url.path, exc_info=exc)
    return JSONResponse(ApiError(500, f"internal error: {type(exc).__name__}", type_="server_error").body(),
                        status_code=500)


@app.exception_handler(ApiError)
async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """FastAPI's own 404 (no such route) and 405 (wrong method), in OpenAI's error shape."""
    message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
    return JSONResponse(ApiError(exc.status_code, message.get(exc.status_code, str(exc.detail))).body(),
                        status_code=exc.status_code, headers=getattr(exc, "headers", None))


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    if first.get("type") == "json_invalid":
        reason = first.get("ctx", {}).get("error", "invalid")
        return JSONResponse(ApiError(400, f"malformed JSON body: {reason}").body(), status_code=400)
    param = _param(first.get("loc", ())) or None
    messages: dict[str, str] = {}  # one per parameter: a union reports each of its branches
    for error in exc.errors():
        messages.setdefault(_param(error.get("loc", ())) or "body", error.get("msg", "invalid"))
    message = "; ".join(f"{where}: {what}" for where, what in list(messages.items())[:5])
    return JSONResponse(ApiError(400, message or "invalid request", param=param).body(), status_code=400)


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "json-or-python"}


def _param(loc) -> str:
    """The client's name for a failing parameter (``messages.0.content``): pydantic's
    location without ``body`` and without the union branches it tried (``str``,
    ``list[int]``, ``function-after[...]``)."""
    return ".".join(str(p) for p in loc[1:] if not (isinstance(p, str) and (p in _TYPE_TAGS or "[" in p)))


class Router:
    @classmethod
    def get_deployment_options(cls, settings: ServeSettings) -> dict:
        """The ingress's Serve options (``deployment_overrides`` go on top): a replica
        holds each of its requests' coroutines, so it takes many at once. Replicas may
        be several, fixed or autoscaled on Serve's request counts (a router's load is its
        requests); each coordinates its own (docs/architecture.md, "Several routers")."""
        return {"name": "Router", "max_ongoing_requests": 256, "ray_actor_options": {"num_cpus": 0.25}}

    def __init__(self, target: DeploymentHandle, proposers: dict[str, DeploymentHandle], settings: dict) -> None:
        self.settings = ServeSettings.model_validate(settings)
        self.bundle = Bundle.load(self.settings.model_dir)
        self.tokenizer = TextTokenizer(self.bundle.target_dir)
        self.chat_template = ChatTemplate.from_model_dir(self.bundle.target_dir)
        self.tool_format = tool_format(self.chat_template)
        self.model_name = self.settings.served_model_name or self.bundle.name
        self.target, self.proposers = target, proposers
        self.transport: ServeTransport | None = None
        self._ready: asyncio.Task | None = None
        self.factory: DriverFactory | None = None
        self.coordinator: RoundCoordinator | None = None
        self.max_context = self.max_tokens_cap = 0
        self.metrics = ServeRoundMetrics()
        self.owner = uuid.uuid4().hex[:12]  # names this router's sequences and its lease (kv_manager.py)
        self.started = int(time.time())  # the model card's ``created``
        self._open_streams = 0  # streaming responses in progress: they share the write budget
        self.write_budget = WriteBudget(self.settings.stream_writes_per_s)
        self._gauges: asyncio.Task | None = None
        self._target_pools: int | None = None  # target pools in the KV ledger, as last seen (``_report_kv``)
        self.readiness = Readiness(serve.get_replica_context().app_name)
        self.guard = RequestGuard(os.environ.get(self.settings.api_key_env), self.settings.max_body_bytes)
        log.info("router: API key %s", "required" if self.guard.api_key else "not configured (open access)")

    # -- start-up ------------------------------------------------------------------------
    async def _ensure_ready(self) -> None:
        """Connect once (``_connect``), and answer within ``READY_WAIT_S`` either way: a
        router whose target is not up yet (pending resources, loading, being replaced)
        raises a 503 that says which deployment and why (``readiness``), however long
        the deployment takes; the connection goes on in the background."""
        # A failed connect is retried by the next request, and so is a cancelled one: Serve
        # cancels the handle calls a request made when its client disconnects, and the first
        # request's client may give up while the replicas are still starting.
        if self._ready is None or (self._ready.done() and (self._ready.cancelled()
                                                           or self._ready.exception() is not None)):
            self._ready = detached(self._connect())
        if not self._ready.done() and not self.readiness.known():  # not known to be pending: give it a moment
            await asyncio.wait({self._ready}, timeout=READY_WAIT_S)  # never cancels the connection
        if not self._ready.done():
            reason = await self.readiness.reason()
            if reason:
                raise self._not_ready(f"specserve is starting: {reason}")
            await asyncio.wait({self._ready}, timeout=CONNECT_WAIT_S)  # healthy: the connection is on its way
            if not self._ready.done():
                raise self._not_ready("specserve is starting: its router has not reached the target yet")
        if self._ready.cancelled() or self._ready.exception() is not None:
            failure = "cancelled" if self._ready.cancelled() else repr(self._ready.exception())
            reason = await self.readiness.reason()
            raise self._not_ready(f"specserve could not reach its target ({failure})"
                                  + (f": {reason}" if reason else ""))
        if self._target_pools == 0:
            reason = await self.readiness.reason()
            raise self._not_ready("no target replica is serving" + (f": {reason}" if reason else " (one is starting)"))

    @staticmethod
    def _not_ready(message: str) -> ApiError:
        return ApiError(503, message + "; retry shortly", type_="service_unavailable", code="not_ready")

    async def _connect(self) -> None:
        """Learn the target's limits and the KV manager once, and wire what each deployed
        proposer mode takes from the target (the registry says; the target's outputs check)."""
        info = await self.target.describe.remote()
        needs = proposer_needs(self.bundle, self.proposers, set(info["extra_outputs"]))
        grammar_compiler(self.tokenizer, info["vocab_size"], info["eos_token_ids"])  # checks requests' grammars
        self.transport = ServeTransport(self.target, self.proposers, info["kv_manager"],
                                        {info["replica"]: info["worker"]})
        self.factory, self.coordinator = coordination(
            self.transport, self.tokenizer, info["eos_token_ids"], info["max_context"], info["vocab_size"],
            self.settings.engine, needs, self.metrics)
        self._gauges = detached(self._report_kv())
        self.max_context = info["max_context"]
        self.max_tokens_cap = min(self.settings.max_tokens_cap or self.max_context, self.max_context)
        log.info("router ready: modes %s, default %s, target providers %s", self.factory.modes,
                 self.factory.default_mode, info["providers"])

    async def _report_kv(self, period_s: float = 1.0) -> None:
        """Keep the KV gauges current (the ledger lives in the KV-manager actor), and how
        many target pools are live: none means requests would only wait (``_ensure_ready``)."""
        while True:
            try:
                usage = await self.transport.kv_call("renew", self.owner)  # this router's lease
                self.metrics.kv(usage)
                self.metrics.load(self.coordinator.active, self.coordinator.waiting)
                self._target_pools = usage["replicas"]
            except Exception as exc:  # noqa: BLE001 - a restarting KV manager must not stop the loop
                log.debug("KV usage unavailable: %s", exc)
            await asyncio.sleep(period_s)

    # -- HTTP ----------------------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> dict:
        await self._ensure_ready()
        return {"status": "ok"}

    @app.get("/version")
    async def version(self) -> dict:
        """vLLM's: the server's version (the installed specserve package's)."""
        try:
            return {"version": importlib.metadata.version("specserve")}
        except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
            return {"version": "unknown"}

    @app.get("/v1/models")
    async def models(self) -> dict:
        await self._ensure_ready()
        return {"object": "list", "data": [self._model_card()]}

    @app.get("/v1/models/{model}")
    async def model(self, model: str) -> dict:
        await self._ensure_ready()
        self._check_model(model)
        return self._model_card()

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.started, "owned_by": "specserve",
                "max_model_len": self.max_context}

    @app.get("/specserve/status")
    async def status(self) -> dict:
        """Operational view: KV blocks, active sequences, where coordinator time goes."""
        await self._ensure_ready()
        t = self.coordinator.timings
        metrics = self.metrics
        return {"kv": await self.transport.kv_call("usage"), "active_sequences": self.coordinator.active,
                "prefix_cache": {"enabled": self.factory.config.caches_prefixes,
                                 "queried_tokens": metrics.prefix_cache_queries,
                                 "hit_tokens": metrics.prefix_cache_hits},
                "open_streams": self._open_streams, "stream_writes": self.write_budget.writes,
                "modes": self.factory.modes, "default_mode": self.factory.default_mode,
                **self._scheduler_stats(),
                "ticks": t.ticks, "sequence_rounds": t.rounds,
                "mean_tick_ms": 1000 * t.tick_s / t.ticks if t.ticks else 0.0,
                "mean_propose_ms": 1000 * t.propose_s / t.ticks if t.ticks else 0.0,
                "mean_target_ms": 1000 * t.target_s / t.ticks if t.ticks else 0.0}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(self) -> dict:
        """vLLM's: forget every cached prefix on every target replica, so the next requests
        run cold (for benchmarks). Running requests keep the blocks they share."""
        await self._ensure_ready()
        return {"status": "ok", "freed_blocks": await self.transport.reset_prefix_cache()}

    @app.post("/reset_suffix_cache")
    async def reset_suffix_cache(self) -> dict:
        """Forget the earlier outputs this router replica's suffix decoding drafts from, so
        the next requests run cold (for benchmarks)."""
        await self._ensure_ready()
        return {"status": "ok", "forgotten_outputs": self.factory.reset_suffix_cache()}

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest):
        await self._ensure_ready()
        self._check_model(body.model)
        prompts = [self._encode(prompt, f"prompt[{i}]" if len(body.prompts) > 1 else "prompt")
                   for i, prompt in enumerate(body.prompts)]
        longest = max(len(ids) for ids in prompts)
        options, speculation = self._options(body, self._max_tokens(body.max_tokens, longest),
                                             body.logprobs is not None, body.logprobs or 0, longest)
        echoes = None
        if body.echo:  # each prompt as sent (ids: their text), and its first token, which has no logprob
            echoes = [Echo(prompt if isinstance(prompt, str) else self.tokenizer.decode(ids),
                           self.tokenizer.token_text(ids[0])) for prompt, ids in zip(body.prompts, prompts)]
            if body.logprobs is not None:
                options = options.model_copy(update={"prompt_logprobs": body.logprobs})
        return await self._serve(body, options, speculation, prompts, chat=False, echoes=echoes)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest):
        await self._ensure_ready()
        self._check_model(body.model)
        tools = tool_plan(body, self.tool_format)
        prompt = render_prompt(self.chat_template, body.messages, tools)
        prompt_ids = self._encode(prompt)
        max_tokens = self._max_tokens(body.max_completion_tokens or body.max_tokens, len(prompt_ids),
                                      "max_completion_tokens" if body.max_completion_tokens else "max_tokens")
        options, speculation = self._options(body, max_tokens, body.logprobs, body.top_logprobs or 0, len(prompt_ids),
                                             tools.structured_output() if tools is not None else None)
        return await self._serve(body, options, speculation, [prompt_ids], chat=True, tools=tools)

    @app.post("/tokenize")
    async def tokenize(self, body: TokenizeRequest) -> dict:
        """vLLM's: the ids a request with this prompt (or these messages) is given, its
        count and the context limit, so a client can size ``max_tokens`` beside it."""
        await self._ensure_ready()
        if body.model is not None:
            self._check_model(body.model)
        text = body.prompt if body.messages is None else render_prompt(self.chat_template, body.messages, None)
        tokens = self.tokenizer.encode(text)
        return {"count": len(tokens), "max_model_len": self.max_context, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(self, body: DetokenizeRequest) -> dict:
        """vLLM's: the text of token ids, special tokens included (a response's text leaves
        them out), so that a prompt's ids give back the prompt."""
        await self._ensure_ready()
        if body.model is not None:
            self._check_model(body.model)
        vocab = self.factory.vocab_size
        if any(t >= vocab for t in body.tokens):
            raise ApiError(400, f"tokens must be token ids below the vocabulary size {vocab}", param="tokens")
        return {"prompt": self.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    # -- internals -----------------------------------------------------------------------
    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"model '{model}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")

    def _max_tokens(self, requested: int | None, prompt_tokens: int, param: str = "max_tokens") -> int:
        """The request's token budget. One it names must fit beside its prompt, as in
        OpenAI's API and vLLM: a client is told, not cut short at the context's end."""
        cap = self.max_tokens_cap
        if requested is None:
            return cap  # as much as the context allows (the KV reservation is capped by it)
        if requested > cap:
            raise ApiError(400, f"{param} is {requested}; this server allows at most {cap}", param=param)
        if prompt_tokens + requested > self.max_context:
            raise ApiError(400, f"this model's maximum context length is {self.max_context} tokens; the request "
                           f"asks for {prompt_tokens + requested} ({prompt_tokens} in the prompt, {requested} for "
                           f"the completion): lower {param} or shorten the prompt", param=param,
                           code="context_length_exceeded")
        return requested

    def _options(self, body, max_tokens: int, logprobs: bool, top: int, prompt_tokens: int,
                 structured_output: StructuredOutput | None = None) -> tuple[GenerationOptions, Speculation]:
        """The request's options, checked against this deployment (``DriverFactory.validate``:
        a structured output's grammar is compiled here, so a bad schema is a 400 naming
        the field it came in)."""
        room = min(max_tokens, self.max_context - prompt_tokens)  # what the request can generate
        if body.min_tokens > room:
            raise ApiError(400, f"min_tokens ({body.min_tokens}) must not exceed what the request can generate "
                           f"({room}: max_tokens, and the context beside the prompt)", param="min_tokens")
        try:
            structured_output = structured_output or body.structured_output()
        except ValidationError as exc:  # an empty regex, an empty list of choices, a schema that is not JSON
            raise ApiError(400, exc.errors()[0]["msg"].removeprefix("Value error, "), param=body.grammar_param) from exc
        try:
            options = body.options(max_tokens, logprobs, top, structured_output)
        except ValidationError as exc:  # the request model checks first: this is a backstop
            first = exc.errors()[0]
            where = ".".join(map(str, first["loc"]))
            raise ApiError(400, f"{where + ': ' if where else ''}{first['msg'].removeprefix('Value error, ')}",
                           param=str(first["loc"][0]) if first["loc"] else None) from exc
        try:
            return options, self.factory.validate(options)
        except InvalidRequestError as exc:
            param = body.grammar_param if exc.param == "structured_output" else exc.param
            raise ApiError(400, str(exc), param=param) from exc

    def _encode(self, prompt, name: str = "prompt") -> list[int]:
        """``name``: what the error calls it (``prompt[i]`` in a batch)."""
        try:
            return self.factory.encode(prompt)
        except InvalidRequestError as exc:
            message = str(exc) if name == "prompt" else f"{name}: {exc}"
            raise ApiError(400, message, param="prompt", code="context_length_exceeded"
                           if "context limit" in str(exc) else None) from exc

    async def _serve(self, body, options: GenerationOptions, speculation: Speculation, prompts: list[list[int]],
                     chat: bool, echoes: list[Echo] | None = None, tools: ToolPlan | None = None):
        """Run the request's choices -- ``n`` per prompt, prompt i's choice j at index
        i * n + j, as vLLM numbers them -- each a sequence of its own (admitted together,
        or the request refused), and answer with all of them, or stream them as they commit."""
        arrived = time.perf_counter()
        queue: asyncio.Queue[ChoiceEvent | None] = asyncio.Queue()
        drivers, stamps = [], []
        jobs = [(prompt_ids, choice) for prompt_ids in prompts for choice in choice_options(options, body.n)]
        for index, (prompt_ids, choice) in enumerate(jobs):
            times: list[float] = []

            def on_token(event: TokenEvent, index: int = index, times: list[float] = times) -> None:
                times.append(time.perf_counter())
                if body.stream:
                    queue.put_nowait(ChoiceEvent(index, event))

            drivers.append(self.factory.create(owned_seq_id(self.owner, uuid.uuid4().hex), prompt_ids, choice,
                                               on_token, speculation))
            stamps.append(times)
        # 503 here, before any stream starts; a choice that cannot be admitted takes its siblings with it
        try:
            admissions = await admit_all(self.coordinator, drivers, lambda driver, outcome: self.metrics.request_done(
                driver.mode, outcome, [], arrived))
        except Exception as exc:  # noqa: BLE001
            raise _as_api_error(exc) from exc
        tasks = []
        for driver, times, admitted in zip(drivers, stamps, admissions):
            task = asyncio.ensure_future(self.coordinator.follow(admitted))
            task.add_done_callback(lambda t, mode=driver.mode, times=times: self.metrics.request_done(
                mode, "cancelled" if t.cancelled() else "error" if t.exception() else "ok", times, arrived))
            tasks.append(task)
        run = asyncio.ensure_future(all_choices(tasks))
        usage = body.stream_options
        shaper = ResponseShaper(self.model_name, chat, body.return_token_ids, usage is not None and usage.include_usage,
                                self.tokenizer.token_bytes, choices_per_prompt=body.n, echoes=echoes,
                                continuous_usage=usage is not None and usage.continuous_usage_stats, tools=tools,
                                event_per_token=self.settings.stream_events == "token")
        if not body.stream:
            try:
                await run
            except asyncio.CancelledError:
                run.cancel()  # the client went away: the coordinator frees the request's KV
                raise
            except Exception as exc:  # noqa: BLE001
                raise _as_api_error(exc) from exc
            return shaper.full(drivers)
        run.add_done_callback(lambda _: queue.put_nowait(None))
        stream = self._stream(drivers, run, queue, shaper)
        cancel_when_dropped(stream, run)
        return StreamingResponse(stream, media_type="text/event-stream")

    def _write_gap_s(self) -> float:
        return self.write_budget.gap_s(time.monotonic(), self._open_streams)

    async def _stream(self, drivers: list, run: asyncio.Future, queue: asyncio.Queue,
                      shaper: ResponseShaper) -> AsyncIterator[str]:
        """Forward committed tokens as they come; a client that disconnects cancels the request."""
        self._open_streams += 1
        try:
            if opening := shaper.opening(drivers):
                yield opening
            async for events in token_writes(queue, self.settings.stream_interval, self._write_gap_s):
                self.write_budget.wrote(time.monotonic())
                yield shaper.tokens(events, drivers)
            failure = run.exception()
            if failure is not None:
                yield shaper.error(_as_api_error(failure))
            elif closing := shaper.closing(drivers):
                yield closing
            yield SSE_DONE
        finally:
            self._open_streams -= 1
            if not run.done():
                run.cancel()  # client disconnected mid-stream: retire the request, free its KV

    # -- for tests and operators (deployment-handle calls) -----------------------------------
    async def kv_usage(self) -> dict:
        """The KV manager's view (releases trail a request's last token by one tick)."""
        await self._ensure_ready()
        return await self.transport.kv_call("usage")

    async def scheduler_stats(self) -> dict:
        """Which target and proposer replicas verified and drafted how many sequence-rounds,
        and recovered faults."""
        await self._ensure_ready()
        return self._scheduler_stats()

    def _scheduler_stats(self) -> dict:
        return {"proposer_replicas": self.transport.proposer_replicas(),
                "target_replicas": self.transport.target_replicas(), "recovered_faults": dict(self.metrics.faults)}


def _as_api_error(exc: BaseException) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, AdmissionError):
        return ApiError(503, str(exc), type_="server_overloaded", code="kv_cache_full")
    if isinstance(exc, InvalidRequestError):
        return ApiError(400, str(exc))
    if isinstance(exc, RequestFailedError):
        return ApiError(500, str(exc), type_="server_error")
    log.exception("request failed", exc_info=exc)
    return ApiError(500, f"internal error: {type(exc).__name__}", type_="server_error")


# The FastAPI routes above are methods of ``Router``; Serve's ingress wrapper binds them
# to the replica's instance. It must run at import time in every process (the app is
# module state), so it is applied here rather than in the builder.
RouterIngress = serve.ingress(app)(Router)
