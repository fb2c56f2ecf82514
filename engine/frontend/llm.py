"""The offline API, shaped like vLLM's: `LLM(model=DIR).generate(prompts, SamplingParams(...))`."""

import itertools
from collections.abc import Sequence

from tqdm import tqdm

from engine.config import EngineConfig
from engine.frontend.llm_engine import LLMEngine
from engine.outputs import RequestOutput, merge_into
from engine.sampling_params import SamplingParams

Prompt = str | dict  # a string, or {"prompt_token_ids": [...]}
PROGRESS_BAR_MIN_PROMPTS = 16


class LLM:
    def __init__(self, model: str, **engine_options) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self._request_ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        add_special_tokens: bool = True,
        lora: str | None | Sequence[str | None] = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in the order of the prompts.

        sampling_params: one for all prompts, or one per prompt (as vLLM takes them); None: the model's
        generation_config defaults. A text prompt is encoded as HF encodes it (its BOS included) unless
        `add_special_tokens` is False. `lora`: a LoRA adapter's name (`add_lora`) for every prompt, or one
        per prompt (None: the base model). A prompt the engine refuses raises, and none of the batch is left
        queued.
        """
        prompts = [prompts] if isinstance(prompts, str | dict) else list(prompts)
        params = sampling_params or SamplingParams(**self.engine.sampling_defaults)
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise ValueError(
                f"{len(per_prompt)} sampling_params for {len(prompts)} prompts: give one, or one each"
            )
        adapters = list(lora) if isinstance(lora, list | tuple) else [lora] * len(prompts)
        order = []
        try:
            for i, (prompt, prompt_params) in enumerate(zip(prompts, per_prompt, strict=True)):
                order.append(str(next(self._request_ids)))
                tokens = prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt
                self.engine.add_request(
                    order[-1],
                    tokens,
                    prompt_params,
                    priority=priority[i] if priority else 0,
                    prompt_token_ids=self.engine.encode(tokens, add_special_tokens),
                    lora=adapters[i],
                )
        except BaseException:
            self._abort(order)
            raise
        return self._run(order, use_tqdm and len(prompts) >= PROGRESS_BAR_MIN_PROMPTS)

    def add_lora(self, name: str, path: str) -> None:
        """Load the PEFT adapter directory `path` as `name` (generate(..., lora=name) runs with it)."""
        self.engine.add_lora(name, path)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.engine.apply_chat_template(conv) for conv in conversations]
        return self.generate(
            prompts, sampling_params, use_tqdm, add_special_tokens=False
        )  # the template's BOS

    def _run(self, order: list[str], show_progress: bool) -> list[RequestOutput]:
        finals: dict[str, RequestOutput] = {}
        progress = tqdm(total=len(order), desc="generate", unit="req", disable=not show_progress)
        try:
            while self.engine.has_unfinished_requests:
                for delta in self.engine.step():
                    whole = finals.setdefault(delta.request_id, delta)
                    if whole is not delta:
                        merge_into(whole, delta)
                    progress.update(int(delta.finished))
        except BaseException:
            self._abort(order)
            raise
        finally:
            progress.close()
        return [finals[request_id] for request_id in order]

    def _abort(self, order: list[str]) -> None:
        for request_id in order:
            self.engine.abort_request(request_id)
