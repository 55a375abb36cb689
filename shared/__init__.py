"""What both services use: model code, checkpoint loading, settings, telemetry, the client, the CLI."""
