"""Constrained decoding with llguidance: a request's grammar becomes a token mask at each step.

- `tokenizers`: llguidance's view of a tokenizer (the base model's, or an adapter's own), built
  once per tokenizer file and EOS set;
- `compiler`: a Grammar -> a prototype matcher, under size/fuel limits and a wall-clock budget,
  cached by (tokenizer, grammar);
- `masks`: per step, the batch's allowed-token mask from its requests' matchers, and advancing
  the matchers by the sampled tokens;
- `grammars`: what the engine calls: validation, compile, a fresh matcher per request.
"""

from quiver_server.grammar.errors import GrammarError
from quiver_server.grammar.grammars import Grammars

__all__ = ["GrammarError", "Grammars"]
