"""Turns an embedding or rerank entry into a `PoolingRequest`, or an error that says what is wrong.

Like `prepare.Preparer`, it runs off the engine thread and only tokenizes and checks
limits: an input past the model's length is refused, or cut to fit when the request
says `truncate` (keeping its start and the model's special tokens).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from client.keys import Keys
from client.pooling import EmbeddingBody, RerankBody, validate_embedding_body, validate_rerank_body
from client.protocol import Envelope, ErrorCode, RequestRejected
from worker.engine.backends import ModelInfo, PoolingInfo
from worker.messages import PoolingRequest, PoolInput, Queueing, RequestRef, Resume
from worker.prepare.generation import check_metadata, longest_token
from worker.settings import WorkerSettings

# Qwen3-Reranker's prompt, as its model card builds it: the answer is "yes" or "no".
QWEN3_RERANK_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and "
                       "the Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n"
                       "<|im_start|>user\n")
QWEN3_RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN3_RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def qwen3_rerank_text(query: str, document: str, instruction: str | None) -> str:
    """What Qwen3-Reranker reads between its fixed prefix and suffix."""
    return f"<Instruct>: {instruction or QWEN3_RERANK_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"


class PoolingPreparer:
    """Validates and tokenizes the requests of one embedding model or reranker."""

    def __init__(self, info: ModelInfo, settings: WorkerSettings) -> None:
        assert info.pooling is not None
        self.pooling: PoolingInfo = info.pooling
        self.name = info.name
        self.tokenizer: Any = info.tokenizer
        self.vocab_size = info.vocab_size
        self.settings = settings
        self.keys = Keys(settings.prefix)
        self.queue = settings.queue
        self.limit = min(settings.max_prompt_tokens or self.pooling.max_length, self.pooling.max_length)
        self.longest_token = longest_token(info.tokenizer) or 64

    def prepare(self, envelope: Envelope, ref: RequestRef, arrived_at: float,
                clock_offset_s: float, resume: Resume | None = None) -> PoolingRequest:
        """A pooling request; raises `RequestRejected` with the field and the reason."""
        if envelope.error is not None:
            raise envelope.error
        assert envelope.raw is not None
        task = self.pooling.task
        try:
            body = validate_embedding_body(envelope.raw) if task == "embed" else validate_rerank_body(envelope.raw)
        except RequestRejected as e:
            if not {"prompt", "messages", "prompt_tokens"} & set(envelope.raw):
                raise
            wanted = "input" if task == "embed" else "query and documents"
            raise RequestRejected(f"this queue's model ({self.name}) serves {task}, not generation: send {wanted} "
                                  f"({e})") from e
        problem = None if body.reply_to is None else self.keys.reply_to_problem(self.queue, body.reply_to)
        if problem:
            raise RequestRejected(problem)
        if body.metadata is not None:
            check_metadata(body.metadata, envelope.encoding, self.settings.max_metadata_bytes)
        deadline_at = None if body.deadline_ms is None else body.deadline_ms / 1000 - clock_offset_s
        request = PoolingRequest(ref, [], Queueing(body.priority, arrived_at, deadline_at, body.metadata))
        if isinstance(body, EmbeddingBody):
            return replace(request, inputs=self._embedding_inputs(body), dimensions=self._dimensions(body.dimensions),
                           base64=body.encoding_format == "base64")
        return replace(request, inputs=self._rerank_inputs(body), top_n=body.top_n)

    def _dimensions(self, wanted: int | None) -> int | None:
        """The size to cut embeddings to, where the model allows it (its Matryoshka sizes)."""
        full, allowed = self.pooling.dimensions, self.pooling.matryoshka
        if wanted is None or wanted == full:
            return None
        if wanted > full:
            raise RequestRejected(f"dimensions: {wanted} is more than this model's embeddings have ({full})")
        if allowed is False:
            raise RequestRejected(f"dimensions: this model ({self.name}) was not trained to be cut (no "
                                  f"Matryoshka sizes in its config); leave dimensions out, or ask for {full}")
        if allowed is not True and wanted not in allowed:
            raise RequestRejected(f"dimensions: this model can be cut to {', '.join(map(str, allowed))} only")
        return wanted

    def _embedding_inputs(self, body: EmbeddingBody) -> list[PoolInput]:
        inputs = body.inputs
        if isinstance(inputs[0], list):
            return [PoolInput(self._checked_ids(i, tokens, body.truncate)) for i, tokens in enumerate(inputs)]
        texts = [self._bounded(f"input {i}", text, body.truncate) for i, text in enumerate(inputs)]  # type: ignore[arg-type]
        encoded = self.tokenizer(texts, truncation=body.truncate, max_length=self.limit if body.truncate else None)
        return [PoolInput(self._fits(f"input {i}", list(ids))) for i, ids in enumerate(encoded["input_ids"])]

    def _rerank_inputs(self, body: RerankBody) -> list[PoolInput]:
        documents = [self._bounded(f"documents {i}", d, body.truncate) for i, d in enumerate(body.documents)]
        self._bounded("query", body.query, False)
        if self.pooling.rerank_format == "qwen3":
            return self._qwen3_pairs(body.query, documents, body.instruction, body.truncate)
        if body.instruction is not None:
            raise RequestRejected(f"instruction: this reranker ({self.name}) is a cross-encoder; it takes none")
        try:
            encoded = self.tokenizer([body.query] * len(documents), documents, max_length=self.limit,
                                     truncation="only_second" if body.truncate else False)
        except Exception as e:  # noqa: BLE001 - the tokenizer's own refusal (a query longer than the limit)
            raise RequestRejected(f"query: cannot be paired within this model's {self.limit} tokens "
                                  f"({ascii(str(e)[:200])})", code=ErrorCode.TOO_LARGE) from e
        type_ids = encoded.get("token_type_ids")
        return [PoolInput(self._fits(f"documents {i}", list(ids), paired=True),
                          None if type_ids is None else list(type_ids[i]))
                for i, ids in enumerate(encoded["input_ids"])]

    def _qwen3_pairs(self, query: str, documents: list[str], instruction: str | None,
                     truncate: bool) -> list[PoolInput]:
        encode = self.tokenizer
        prefix, suffix = (encode(QWEN3_RERANK_PREFIX, add_special_tokens=False)["input_ids"],
                          encode(QWEN3_RERANK_SUFFIX, add_special_tokens=False)["input_ids"])
        room = self.limit - len(prefix) - len(suffix)
        texts = [qwen3_rerank_text(query, d, instruction) for d in documents]
        middles = encode(texts, add_special_tokens=False)["input_ids"]
        return [PoolInput(self._fits(f"documents {i}", prefix + (list(m)[:room] if truncate else list(m)) + suffix,
                                      paired=True))
                for i, m in enumerate(middles)]

    def _bounded(self, where: str, text: str, truncate: bool) -> str:
        """Refuse a text too long to fit from its length alone, before tokenizing it (a token
        never spans more characters than the longest in the vocabulary); with `truncate`,
        cut it to what could still matter."""
        most = self.limit * self.longest_token
        if len(text) <= most:
            return text
        if truncate:
            return text[: 2 * most]
        raise RequestRejected(f"{where}: {len(text)} characters is more than this model's {self.limit} "
                              "tokens can hold; shorten it, or send truncate: true", code=ErrorCode.TOO_LARGE)

    def _fits(self, where: str, tokens: list[int], paired: bool = False) -> list[int]:
        if len(tokens) > self.limit:
            what = "with the query, " if paired else ""
            raise RequestRejected(f"{where}: {what}{len(tokens)} tokens is above this model's limit "
                                  f"({self.limit}); shorten it, or send truncate: true", code=ErrorCode.TOO_LARGE)
        if not tokens:
            raise RequestRejected(f"{where}: encodes to no tokens")
        return tokens

    def _checked_ids(self, index: int, tokens: list[int], truncate: bool) -> list[int]:
        outside = [t for t in tokens if t >= self.vocab_size]
        if outside:
            raise RequestRejected(f"input {index}: token ids {outside[:5]} are outside the vocabulary "
                                  f"(size {self.vocab_size})")
        return self._fits(f"input {index}", tokens[: self.limit] if truncate else tokens)
