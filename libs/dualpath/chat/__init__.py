"""The chat API's model-facing half: the checkpoint's chat template (``template``), tool-call
formats and their forcing grammars (``tools``), streamed tool-call deltas (``stream``), and
request planning (``plan``: messages, tools and response_format -> prompt text, grammar, output
parser), with the errors the gateway answers as 400 (``errors``)."""
