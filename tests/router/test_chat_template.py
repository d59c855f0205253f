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
