"""Who may connect and how much: keys, ephemeral keys, Twilio signatures, quotas, and the
OpenAI-shaped errors that refuse them."""
