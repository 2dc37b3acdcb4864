//! A decoded control-message body: the dispatch over RDMAP's bodies (`rdmap.rs`) and the
//! Terminate (`terminate.rs`) by opcode, for the receiver.

use super::codes::Opcode;
use super::error::Result;
use super::rdmap::{
    fixed, AtomicRequest, AtomicResponse, AtomicWriteRequest, FlushRequest, PrivateResponse,
    ReadRequest,
};
use super::terminate::Terminate;

/// A decoded control-message body (everything but Write, Read Response and the Sends).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Body {
    /// Read Request.
    ReadRequest(ReadRequest),
    /// Terminate.
    Terminate(Terminate),
    /// Immediate Data (with or without Solicited Event: see the header's opcode).
    ImmediateData([u8; 8]),
    /// Atomic Request.
    AtomicRequest(AtomicRequest),
    /// Atomic Response.
    AtomicResponse(AtomicResponse),
    /// Flush Request.
    FlushRequest(FlushRequest),
    /// Atomic Write Request.
    AtomicWriteRequest(AtomicWriteRequest),
    /// Flush / Atomic Write response.
    PrivateResponse(PrivateResponse),
}

impl Body {
    /// Decodes the body of a control message with opcode `opcode`; None for data opcodes.
    ///
    /// # Errors
    /// Those of the body's own `decode`.
    pub fn decode(opcode: Opcode, b: &[u8]) -> Result<Option<Body>> {
        Ok(Some(match opcode {
            Opcode::ReadRequest => Body::ReadRequest(ReadRequest::decode(b)?),
            Opcode::Terminate => Body::Terminate(Terminate::decode(b)?),
            Opcode::ImmediateData | Opcode::ImmediateDataSe => {
                let mut r = fixed(b, opcode, 8, "Immediate Data")?;
                Body::ImmediateData(r.array()?)
            }
            Opcode::AtomicRequest => Body::AtomicRequest(AtomicRequest::decode(b)?),
            Opcode::AtomicResponse => Body::AtomicResponse(AtomicResponse::decode(b)?),
            Opcode::FlushRequest => Body::FlushRequest(FlushRequest::decode(b)?),
            Opcode::AtomicWriteRequest => Body::AtomicWriteRequest(AtomicWriteRequest::decode(b)?),
            Opcode::PrivateResponse => Body::PrivateResponse(PrivateResponse::decode(b)?),
            _ => return Ok(None),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn immediate_data_is_eight_bytes_and_data_opcodes_have_no_body() {
        assert!(Body::decode(Opcode::ImmediateData, &[0u8; 7]).is_err());
        assert_eq!(
            Body::decode(Opcode::ImmediateDataSe, &[1u8; 8]).unwrap(),
            Some(Body::ImmediateData([1; 8]))
        );
        assert_eq!(Body::decode(Opcode::Write, &[]).unwrap(), None);
    }
}
