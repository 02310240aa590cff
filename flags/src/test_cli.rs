//! The serving flags alone on a command line, flattened as each binary flattens them: the parser
//! this crate's tests read flags back with.

use std::ffi::OsString;

use clap::Parser;

use crate::ServingFlags;

#[derive(Parser)]
pub(crate) struct Cli {
    #[command(flatten)]
    pub(crate) flags: ServingFlags,
}

/// `args` after a program name, parsed as the router parses them; clap's message on a refusal.
pub(crate) fn try_parse<T: Into<OsString>>(
    args: impl IntoIterator<Item = T>,
) -> Result<ServingFlags, String> {
    let argv =
        std::iter::once(OsString::from("quiver-router")).chain(args.into_iter().map(Into::into));
    Cli::try_parse_from(argv)
        .map(|cli| cli.flags)
        .map_err(|error| error.to_string())
}
