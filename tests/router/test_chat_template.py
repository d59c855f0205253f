"""The chat template renderer (router/http/chat_template.py): a request's own template variables."""

from __future__ import annotations

import pytest

from router.http.chat_template import RESERVED, ChatTemplate, ChatTemplateError

THINKING = ChatTemplate(
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% if enable_thinking is false %} <think></think>"
    "{% endif %}{% endif %}"
)
MESSAGES = [{"role": "user", "content": "hi"}]


def test_a_requests_variables_reach_the_template() -> None:
    assert THINKING.render(MESSAGES) == "user: hi\nassistant:"
    assert (
        THINKING.render(MESSAGES, variables={"enable_thinking": False})
        == "user: hi\nassistant: <think></think>"
    )
    assert THINKING.render(MESSAGES, variables={"enable_thinking": True}) == "user: hi\nassistant:"


@pytest.mark.parametrize("name", sorted(RESERVED))
def test_what_the_server_gives_the_template_cannot_be_replaced(name: str) -> None:
    with pytest.raises(ChatTemplateError, match=f"^chat_template_kwargs may not set {name}$"):
        THINKING.render(MESSAGES, variables={name: "x"})


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TRIMMING = CHATML.replace("{{ m.content }}", "{{ m.content | trim }}")


@pytest.mark.parametrize("source", [CHATML, TRIMMING], ids=["keeps", "trims"])
@pytest.mark.parametrize("final", ["Sure", "Sure, ", "  spaced  ", "hi"])  # "hi": also an earlier message
def test_continue_final_message_cuts_as_transformers_does(tokenizer_dir, source: str, final: str) -> None:
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.chat_template = source
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": final}]
    want = tokenizer.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    got = ChatTemplate(source).render(chat, add_generation_prompt=False, continue_final_message=True)
    assert got == want


def test_continue_final_message_needs_text_the_prompt_holds() -> None:
    template = ChatTemplate("{% for m in messages %}{{ m.role }}{% endfor %}")
    with pytest.raises(ChatTemplateError, match="the final message does not appear in the prompt"):
        template.render([{"role": "assistant", "content": "x"}], False, continue_final_message=True)
    with pytest.raises(ChatTemplateError, match="needs a final message with text"):
        template.render([{"role": "assistant", "content": " "}], False, continue_final_message=True)


RAG = (
    "{% if documents %}{% for d in documents %}<doc {{ d.doc_id }}>{{ d.text }}</doc>\n"
    "{% endfor %}{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
)


def test_documents_reach_the_template_as_transformers_passes_them(tokenizer_dir) -> None:
    """`documents` (vLLM's field; Granite's RAG templates read it) as transformers'
    apply_chat_template(documents=...) renders them; also as a chat_template_kwargs variable,
    not both."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.chat_template = RAG
    documents = [{"doc_id": "1", "text": "Oslo is cold."}, {"doc_id": "2", "text": "Rome is warm."}]
    want = tokenizer.apply_chat_template(MESSAGES, documents=documents, tokenize=False)
    template = ChatTemplate(RAG)
    assert template.render(MESSAGES, documents=documents) == want
    assert template.render(MESSAGES, variables={"documents": documents}) == want
    assert (
        template.render(MESSAGES) == tokenizer.apply_chat_template(MESSAGES, tokenize=False) == "user: hi\n"
    )
    with pytest.raises(ChatTemplateError, match="documents are given twice"):
        template.render(MESSAGES, documents=documents, variables={"documents": documents})
