"""The OpenAI surface: request bodies parsed, a generation prepared and run, responses and SSE streams."""
