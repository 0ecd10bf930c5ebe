"""``POST /tokenize`` and ``POST /detokenize``. vLLM: ``entrypoints/openai/serving_tokenization.py``.

``/tokenize`` takes a ``prompt`` (``add_special_tokens`` default true) or chat ``messages`` (rendered with the
chat template as ``/v1/chat/completions`` renders them; ``add_special_tokens`` default false) and answers
``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs``: the vocabulary strings, with
``return_token_strs``). ``/detokenize`` takes ``tokens`` and answers ``{"prompt"}``.
"""

from __future__ import annotations

from typing import Any

from models.entrypoints.openai.chat_utils import render_chat
from models.entrypoints.openai.protocol import (
    DetokenizeRequest,
    OpenAIError,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from models.entrypoints.openai.serving_engine import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    """The tokenizer routes (no engine involved)."""

    def tokenize(self, request: TokenizeCompletionRequest | TokenizeChatRequest) -> dict[str, Any]:
        """Token ids of a prompt or a conversation.

        Raises:
            OpenAIError: 404 for the model; 400 when the chat template rejects the messages.
        """
        self.check_model(request.model)
        if isinstance(request, TokenizeChatRequest):
            if request.continue_final_message and request.add_generation_prompt:
                raise OpenAIError("Invalid request: 'continue_final_message' and 'add_generation_prompt' cannot "
                                  "both be true", param="continue_final_message")
            tools = None if request.tools is None else [t.model_dump(exclude_none=True) for t in request.tools]
            text = render_chat(self.tokenizer, request.messages, add_generation_prompt=request.add_generation_prompt,
                               continue_final_message=request.continue_final_message, tools=tools,
                               chat_template_kwargs=request.chat_template_kwargs)
        else:
            text = request.prompt
        ids = self.tokenizer.encode(text, add_special_tokens=request.add_special_tokens)
        strs = [self.tokenizer.id_to_token(t) for t in ids] if request.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strs}

    def detokenize(self, request: DetokenizeRequest) -> dict[str, Any]:
        """The text of token ids (special tokens included, as vLLM decodes them).

        Raises:
            OpenAIError: 404 for the model; 400 for ids outside the vocabulary.
        """
        self.check_model(request.model)
        ids = self.check_token_ids(request.tokens, "tokens")
        return {"prompt": self.tokenizer.decode(ids, skip_special_tokens=False)}
