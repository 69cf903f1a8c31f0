"""vLLM's /tokenize and /detokenize over the Frontend: what the server's tokenizer makes of a prompt or a
chat (clients align prompt lengths with it: ``vllm bench serve``, SGLang's tooling), and token ids back
to text. A chat is rendered exactly as /v1/chat/completions renders it (actors/openai_chat.py), so the
count is the prompt the chat route would feed the model. Errors are OpenAI's 400s."""
from __future__ import annotations

from fastapi import FastAPI

from actors.frontend import Frontend, bad
from actors.http_models import DetokenizeResponse, TokenizeResponse, errors
from actors.openai_chat import plan_chat
from actors.requests import ChatRequest, DetokenizeRequest, TokenizeRequest
from actors.sse import reply


def tokenize(fe: Frontend, body: TokenizeRequest) -> dict:
    fe.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad("prompt", "exactly one of prompt or messages is required")
    if body.prompt is not None:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = fe.encode(body.prompt, "prompt", special) if body.prompt else []
    else:
        # The chat route's own plan: the same template, tools (described in a system message when the
        # template does not render them) and generation prompt.
        chat = ChatRequest.model_construct(
            messages=body.messages, tools=body.tools, add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message, chat_template=body.chat_template,
            chat_template_kwargs=body.chat_template_kwargs)
        ids = fe.encode(plan_chat(chat, fe.tok).prompt, "messages", bool(body.add_special_tokens))
    out = {"count": len(ids), "max_model_len": fe.backend.max_context, "tokens": ids, "token_strs": None}
    if body.return_token_strs:
        out["token_strs"] = [fe.tok.piece(t) or "" for t in ids]
    return out


def detokenize(fe: Frontend, body: DetokenizeRequest) -> dict:
    fe.check_model(body.model)
    vocab = fe.backend.vocab_size
    out = [t for t in body.tokens if t >= vocab]
    if out:
        raise bad("tokens", f"token id {out[0]} is outside the vocabulary [0, {vocab})")
    # Special tokens stay in (vLLM decodes with the tokenizer's default, which keeps them).
    return {"prompt": fe.tok.decode(body.tokens, skip_special_tokens=False)}


def add_tokenize_routes(app: FastAPI, fe: Frontend) -> None:
    @app.post("/tokenize", response_model=TokenizeResponse, responses=errors(400, 404, 413))
    async def tokenize_route(body: TokenizeRequest):
        return reply(tokenize(fe, body), body)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=errors(400, 404, 413))
    async def detokenize_route(body: DetokenizeRequest):
        return reply(detokenize(fe, body), body)
