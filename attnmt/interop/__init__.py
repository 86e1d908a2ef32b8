"""Other toolkits' models: fairseq 0.12 transformer checkpoints in and out, CTranslate2 model directories out.

``attnmt import-fairseq`` and ``attnmt export --to fairseq|ctranslate2`` are thin commands over these modules.
Importing needs nothing beyond attnmt's own dependencies; exporting needs the target toolkit installed (fairseq
0.12, or ``pip install 'attnmt[ctranslate2]'``), which is never a core dependency.
"""
