// The --api-keys file: one key per line, optionally followed by that key's quotas, which override the
// flags' defaults for it:
//   KEY [sessions=N] [waiting=N] [running=N] [priority=LO..HI]
// Blank lines and lines starting with '#' are skipped; a plain one-key-per-line file stays valid.
#pragma once

#include <istream>
#include <map>
#include <string>

#include "engine/engine.h"

namespace qkv::server {

// Key -> its quota (defaults where the line says nothing). Errors name the line.
StatusOr<std::map<std::string, TenantQuota>> ParseApiKeys(std::istream& in, const TenantQuota& defaults);
// "LO..HI" -> (lo, hi).
Status ParsePriorityRange(const std::string& s, int* lo, int* hi);

}  // namespace qkv::server
