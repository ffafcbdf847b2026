"""Chat templates the tool-template and tool-env tests share."""

from __future__ import annotations

#: Not prefix-stable on purpose: ChatML that drops the <think> part of every assistant turn but the
#: last (as templates that strip reasoning from the history do).
STRIP_HISTORY_THINK = (
    "{%- for m in messages %}"
    "{%- set content = m.content %}"
    "{%- if m.role == 'assistant' and not loop.last and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1] %}{%- endif %}"
    "{{- '<|im_start|>' + m.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
