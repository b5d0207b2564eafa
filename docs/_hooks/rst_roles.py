"""MkDocs hook: drop reST roles (``:func:``, ``:class:`` ...) left in rendered docstrings.

The package's docstrings name other objects the Sphinx way (:func:`save_checkpoint`);
Markdown renders that as the role's text followed by a code span. Keep the code span.
"""
import re

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|exc|data|obj):(?=<code)")


def on_page_content(html, page, config, files):
    return _ROLE.sub("", html)
