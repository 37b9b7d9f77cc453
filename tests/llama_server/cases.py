"""The requests llama-server answered in recorded.json, in the order they were sent (the slot
actions depend on the completions before them), and that the tests send slotwise again.

"IMAGE" as a prompt is a multimodal prompt with one image (`answer` builds it).
"""

from __future__ import annotations

import base64
import json
from typing import Any

import httpx

from support.media import image_bytes

MARKER = "<__media__>"  # slotwise's; llama-server's is random unless LLAMA_MEDIA_MARKER pins it

GREEDY = {"temperature": 0}
HELLO = {"prompt": "Hello world", **GREEDY}
CHAT = [{"role": "user", "content": "Hi"}]


def post(path: str, body: Any = None) -> dict[str, Any]:
    return {"method": "POST", "path": path, "body": {} if body is None else body}


def get(path: str) -> dict[str, Any]:
    return {"method": "GET", "path": path}


CASES: dict[str, dict[str, Any]] = {
    "props": get("/props"),
    "slots": get("/slots"),
    "tokenize": post("/tokenize", {"content": "Hello world"}),
    "tokenize_pieces": post(
        "/tokenize", {"content": "Hello <|im_end|>\u00e1", "with_pieces": True, "add_special": True}
    ),
    "tokenize_plain": post("/tokenize", {"content": "<|im_end|>", "parse_special": False}),
    "tokenize_nothing": post("/tokenize"),
    "detokenize": post("/detokenize", {"tokens": [72, 101, 108, 108, 111, 262, 195, 161]}),
    "detokenize_nothing": post("/detokenize"),
    "apply_template": post(
        "/apply-template",
        {"messages": [{"role": "system", "content": "Be brief."}, *CHAT]},
    ),
    "apply_template_prefill": post(
        "/apply-template", {"messages": [*CHAT, {"role": "assistant", "content": "Hel"}]}
    ),
    "apply_template_no_messages": post("/apply-template"),
    "completion": post("/completion", {**HELLO, "n_predict": 4}),
    "completion_probs": post(
        "/completion", {**HELLO, "n_predict": 3, "n_probs": 2, "return_tokens": True}
    ),
    "completion_stream": post(
        "/completion",
        {
            **HELLO,
            "n_predict": 3,
            "stream": True,
            "return_progress": True,
            "timings_per_token": True,
        },
    ),
    "completion_tokens": post(
        "/completion",
        {"prompt": [72, 101, 108, 108, 111], "n_predict": 3, "return_tokens": True, **GREEDY},
    ),
    "completion_mixed": post(
        "/completion", {"prompt": ["Hello", 32, "world"], "n_predict": 3, **GREEDY}
    ),
    "completion_multi": post(
        "/completion", {"prompt": ["Hello", "world"], "n_predict": 2, **GREEDY}
    ),
    "completion_grammar": post(
        "/completion", {"prompt": "x", "n_predict": 8, "grammar": 'root ::= "yes" | "no"', **GREEDY}
    ),
    "completion_json_schema": post(
        "/completion",
        {
            "prompt": "x",
            "n_predict": 64,
            **GREEDY,
            "json_schema": {
                "type": "object",
                "properties": {"a": {"type": "boolean"}},
                "required": ["a"],
                "additionalProperties": False,
            },
        },
    ),
    "completion_stop": post("/completion", {**HELLO, "n_predict": 8, "stop": ["dd"]}),
    "completion_samplers": post(
        "/completion", {**HELLO, "n_predict": 3, "samplers": ["top_k", "temperature"]}
    ),
    "completion_image": post("/completion", {"prompt": "IMAGE", "n_predict": 3, **GREEDY}),
    "completion_n_predict_0": post("/completion", {**HELLO, "n_predict": 0}),
    "completion_fields": post(
        "/completion",
        {**HELLO, "n_predict": 2, "response_fields": ["content", "generation_settings/n_predict"]},
    ),
    "completion_no_prompt": post("/completion"),
    "completion_empty_list": post("/completion", {"prompt": []}),
    "completion_bad_token": post("/completion", {"prompt": [99999], "n_predict": 1}),
    "completion_too_long": post("/completion", {"prompt": "ab " * 600, "n_predict": 1}),
    "completion_bad_type": post("/completion", {"prompt": "x", "n_predict": "a"}),
    "completion_slot0": post("/completion", {**HELLO, "n_predict": 4, "id_slot": 0}),
    "slot_save": post("/slots/0?action=save", {"filename": "a.bin"}),
    "slot_erase": post("/slots/0?action=erase"),
    "slot_restore": post("/slots/0?action=restore", {"filename": "a.bin"}),
    "completion_slot0_again": post(
        "/completion", {"prompt": "Hello worlddddd, again", "n_predict": 2, "id_slot": 0, **GREEDY}
    ),
    "slot_bad_id": post("/slots/9?action=erase"),
    "slot_bad_action": post("/slots/0?action=fly"),
    "slot_bad_filename": post("/slots/0?action=save", {"filename": "../x.bin"}),
    "slot_restore_missing": post("/slots/0?action=restore", {"filename": "nope.bin"}),
    "infill": post("/infill", {"input_prefix": "def f(", "input_suffix": ")\n"}),
    "rerank": post("/rerank", {"query": "q", "documents": ["a", "b"]}),
    "embedding_off": post("/embedding", {"content": "Hello"}),
    "props_post": post("/props", {}),
    "chat_input_tokens": post("/v1/chat/completions/input_tokens", {"messages": CHAT}),
    "responses_input_tokens": post(
        "/v1/responses/input_tokens", {"input": "Hi", "instructions": "Be brief."}
    ),
    "chat": post("/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, **GREEDY}),
    "chat_stream": post(
        "/v1/chat/completions",
        {
            "messages": CHAT,
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
            **GREEDY,
        },
    ),
    "chat_prefill": post(
        "/v1/chat/completions",
        {"messages": [*CHAT, {"role": "assistant", "content": "Hel"}], "max_tokens": 2, **GREEDY},
    ),
    "chat_two_assistants": post(
        "/v1/chat/completions",
        {
            "messages": [
                *CHAT,
                {"role": "assistant", "content": "a"},
                {"role": "assistant", "content": "b"},
            ],
            "max_tokens": 2,
        },
    ),
    "chat_continue_and_prompt": post(
        "/v1/chat/completions",
        {
            "messages": [*CHAT, {"role": "assistant", "content": "a"}],
            "max_tokens": 2,
            "continue_final_message": True,
            "add_generation_prompt": True,
        },
    ),
    "chat_stream_progress": post(
        "/v1/chat/completions",
        {
            "messages": CHAT,
            "max_tokens": 2,
            "stream": True,
            "return_progress": True,
            "timings_per_token": True,
            **GREEDY,
        },
    ),
    "completions_oai": post("/v1/completions", {"prompt": "Hi", "max_tokens": 3, **GREEDY}),
}

EMBEDDING_CASES: dict[str, dict[str, Any]] = {
    "embedding": post("/embedding", {"content": "Hello"}),
    "embedding_many": post("/embedding", {"content": ["Hello", "world"]}),
}

NO_SLOT_PATH_CASES: dict[str, dict[str, Any]] = {
    "slot_save_off": post("/slots/0?action=save", {"filename": "a.bin"}),
}

# on the model with fill-in-the-middle tokens (fim.py)
FIM_CASES: dict[str, dict[str, Any]] = {
    "infill_fim": post(
        "/infill", {"input_prefix": "def f(", "input_suffix": ")\n", "n_predict": 4, **GREEDY}
    ),
    "infill_extra": post(
        "/infill",
        {
            "input_prefix": "x = ",
            "input_suffix": "\n",
            "prompt": "1",
            "input_extra": [{"filename": "a.py", "text": "y = 2\n"}],
            "n_predict": 3,
            **GREEDY,
        },
    ),
    "infill_no_suffix": post("/infill", {"input_prefix": "x"}),
}


IMAGE = base64.b64encode(image_bytes(64, 48)).decode()


def answer(url: str, case: dict[str, Any]) -> dict[str, Any]:
    """A server's answer to a case: its status and its body, or its stream's events."""
    body = case.get("body")
    if isinstance(body, dict) and body.get("prompt") == "IMAGE":
        body = {**body, "prompt": {"prompt_string": f"a {MARKER} b", "multimodal_data": [IMAGE]}}
    r = httpx.request(case["method"], f"{url}{case['path']}", json=body, timeout=120)
    out: dict[str, Any] = {"status": r.status_code}
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        out["events"] = [
            json.loads(line[len("data: ") :])
            for line in r.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
    else:
        out["body"] = r.json()
    return out
