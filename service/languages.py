"""A language code as OpenAI's verbose_json names it: Whisper's lowercase English name ("en" -> "english")."""

from __future__ import annotations

# The European languages the Parakeet family transcribes (parakeet-tdt-0.6b-v3 covers all of them); a code
# outside the table is answered as given.
LANGUAGE_NAMES = {
    "bg": "bulgarian", "cs": "czech", "da": "danish", "de": "german", "el": "greek", "en": "english",
    "es": "spanish", "et": "estonian", "fi": "finnish", "fr": "french", "hr": "croatian", "hu": "hungarian",
    "it": "italian", "lt": "lithuanian", "lv": "latvian", "mt": "maltese", "nl": "dutch", "pl": "polish",
    "pt": "portuguese", "ro": "romanian", "ru": "russian", "sk": "slovak", "sl": "slovenian", "sv": "swedish",
    "uk": "ukrainian",
}


def language_name(code: str) -> str:
    return LANGUAGE_NAMES.get(code, code)
