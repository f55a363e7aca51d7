"""README.md and docs/: every relative link leads to a file of the repository, and every #anchor to one of that
file's headings (as GitHub makes their anchors: lower case, punctuation dropped but hyphens, spaces as hyphens)."""
import functools
import os
import re

from tepokit.tests.helpers import REPO


def anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def prose(path: str) -> str:
    """The page without its code blocks: a '# comment' there is no heading, a `](x)` no link."""
    return re.sub(r"```.*?```", "", open(path).read(), flags=re.S)


@functools.cache
def headings(path: str) -> set:
    """The anchors of a page's headings (read once per page, however many links point into it)."""
    return {anchor(line.lstrip("#")) for line in prose(path).splitlines() if re.match(r"#{1,6} ", line)}


def links(path: str) -> list:
    return [m[1] for m in re.finditer(r"\]\(([^)\s]+)\)", prose(path)) if not re.match(r"[a-z]+:", m[1])]


def test_every_relative_link_of_the_docs_leads_somewhere():
    pages = ["README.md"] + [os.path.join("docs", name) for name in sorted(os.listdir(os.path.join(REPO, "docs")))
                             if name.endswith(".md")]
    broken, checked = [], 0
    for page in pages:
        for target in links(os.path.join(REPO, page)):
            checked += 1
            path, _, fragment = target.partition("#")
            full = os.path.normpath(os.path.join(REPO, os.path.dirname(page), path or os.path.basename(page)))
            if not os.path.exists(full) or (fragment and full.endswith(".md") and fragment not in headings(full)):
                broken.append(f"{page}: {target}")
    assert not broken and checked > 100


def test_the_anchors_are_githubs():
    assert anchor("Decoding precision (`--decode-precision`)") == "decoding-precision---decode-precision"
    assert anchor("Memory of the one-GPU path, measured on the CPU") == "memory-of-the-one-gpu-path-measured-on-the-cpu"
